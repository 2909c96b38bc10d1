"""The names of saves in progress (a local tmp dir, DCP's named area, an object store's claim)
hold nothing of their checkpoint's name: a process killed anywhere in a commit leaves nothing
that a scan picking checkpoints by name (torchtitan's resume) takes for a checkpoint, while
asynctron still finds, skips and sweeps what it left."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asynctron
from asynctron.dcp import StorageWriter
from asynctron.storage import LocalBackend
from asynctron.storage.backends.objects._layout import (
    claim_name,
    claimed_checkpoint,
    is_checkpoint_name,
    is_claim_name,
    is_claim_to,
)
from tests.conftest import assert_same

CHILD = textwrap.dedent("""
    import sys, threading
    import torch
    import torch.distributed.checkpoint as dcp
    import asynctron
    from asynctron.dcp import StorageWriter
    from asynctron.storage.backends.local import _publish
    from asynctron.storage.node_files import _sysio

    root, kind, point = sys.argv[1:]
    # Each point of the commit: the call of a function (made from a caller, where one is named).
    function, caller = {
        "data_written": (_publish.seal_dir, None),
        "metadata_written": (_sysio.fsync_dir, _publish.seal_dir),
        "before_rename": (_sysio.rename_no_replace, _publish.publish_dir),
        "renamed": (_sysio.fsync_dir, _publish.publish_dir),
    }[point]

    def stop_there(frame, event, arg):
        if event == "call" and frame.f_code is function.__code__ and (
                caller is None or frame.f_back.f_code is caller.__code__):
            print("ready", flush=True)
            threading.Event().wait()  # until the test kills this process

    threading.setprofile(stop_there)  # the executors' threads start after this
    sys.setprofile(stop_there)
    state = {"w": torch.full((1000,), 2.0), "v": torch.arange(2.0)}
    if kind == "dcp":
        dcp.save(state, storage_writer=StorageWriter(f"{root}/step-2"))
    else:
        asynctron.save(state, f"{root}/step-2")
""")

POINTS = ["data_written", "metadata_written", "before_rename", "renamed"]


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(step)), "v": torch.arange(float(step))}


def _save(kind: str, step: int, root: str) -> None:
    if kind == "dcp":
        dcp.save(_state(step), storage_writer=StorageWriter(f"{root}/step-{step}"))
    else:
        asynctron.save(_state(step), f"{root}/step-{step}")


def _load(kind: str, path: str, step: int) -> dict[str, Any]:
    if kind == "dcp":  # stock DCP, as torchtitan loads
        target = {"w": torch.zeros(1000), "v": torch.zeros(step)}
        dcp.load(target, checkpoint_id=path)
        return target
    return asynctron.load(path)


def _newest_step(root: str, marker: str) -> int:
    """torchtitan's `CheckpointManager` resume scan: the newest folder whose name matches
    `step-(\\d+)` and that holds `marker` (DCP's `.metadata`), or -1."""
    steps = [int(match.group(1)) for name in os.listdir(root)
             if (match := re.search(r"step-(\d+)", name))
             and os.path.isfile(os.path.join(root, name, marker))]
    return max(steps, default=-1)


def _committed(root: str) -> list[str]:
    checkpoints = LocalBackend().checkpoints(asyncio.to_thread)
    return asyncio.run(checkpoints.list_checkpoints(root))


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("kind", ["dcp", "engine"])
def test_a_save_killed_anywhere_in_its_commit_is_never_resumed_from(
        tmp_path: Any, kind: str, point: str) -> None:
    """SIGKILL at each point of a save's commit (data written; `.metadata` and the manifest
    written in the area; about to rename; renamed, `latest` not moved): a torchtitan-style
    scan finds a committed step that loads (the previous one, or the new one once renamed),
    never the area; asynctron's listing skips the area; the next commit removes it."""
    root = str(tmp_path)
    _save(kind, 1, root)
    with subprocess.Popen([sys.executable, "-c", CHILD, root, kind, point],
                          stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    areas = [name for name in os.listdir(root) if name.startswith(".")]
    renamed = point == "renamed"
    assert len(areas) == (0 if renamed else 1), areas

    step = _newest_step(root, ".metadata" if kind == "dcp" else "manifest.json")
    assert step == (2 if renamed else 1)
    assert_same(_state(step), _load(kind, f"{root}/step-{step}", step))
    assert _committed(root) == (["step-1", "step-2"] if renamed else ["step-1"])
    if kind == "engine":
        assert_same(_state(1), asynctron.load(root))  # `latest` was never moved

    _save(kind, 3, root)
    left = {"step-1", "step-3"} | ({"step-2"} if renamed else set())
    assert set(os.listdir(root)) == left | ({"latest"} if kind == "engine" else set())


def test_a_claim_name_holds_nothing_of_its_checkpoints_its_body_does() -> None:
    """A claim on an object store is `.asynctron.tmp-<digest>-<hex>`: every claim to one
    checkpoint shares the prefix, and its body (the checkpoint's name) says whose it is, only
    where the name agrees; a claim of an earlier version (`.<checkpoint>.tmp-…`) still is."""
    named = claim_name("step-4", "dcp")
    assert named == claim_name("step-4", "dcp") != claim_name("step-4", "drain-4")
    fresh = {claim_name("step-4", None) for _ in range(3)}
    assert len(fresh) == 3
    for name in {named, *fresh}:
        assert re.fullmatch(r"\.asynctron\.tmp-[0-9a-f]{16}-[0-9a-f]{16}", name), name
        assert is_claim_to(name, "step-4") and not is_claim_to(name, "step-40")
        assert is_claim_name(name) and not is_checkpoint_name(name)
        assert claimed_checkpoint(name, {"checkpoint": "step-4"}) == "step-4"
        assert claimed_checkpoint(name, {"checkpoint": "step-5"}) is None
        assert claimed_checkpoint(name, {"checkpoint": ".hidden"}) is None
        assert claimed_checkpoint(name, {}) is None
    earlier = ".step-4.tmp-host-12-0a0b0c0d"
    assert is_claim_name(earlier) and is_claim_to(earlier, "step-4")
    assert claimed_checkpoint(earlier, {"checkpoint": "step-4"}) == "step-4"
    assert claimed_checkpoint(earlier, {"checkpoint": "step-5"}) is None
