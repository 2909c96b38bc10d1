"""A save's claim on each object store holds nothing of its checkpoint's name: a saver killed
with its claim and data up, its commit point not yet written, leaves nothing a scan picking
checkpoints by name (torchtitan's) takes for one, and the next commit beside it finds the
claim dead by its body and removes what it names."""

from __future__ import annotations

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
from asynctron.dcp import StorageReader, StorageWriter
from tests.conftest import assert_same
from tests.objects.conftest import Store

pytestmark = pytest.mark.slow  # each kills a saving process

CHILD = textwrap.dedent("""
    import sys, threading, torch, uvloop
    import torch.distributed.checkpoint as dcp
    from asynctron import Engine
    from asynctron.dcp import StorageWriter
    from asynctron.storage import backend_for
    from asynctron.storage.backends.objects import ObjectStoreBackend
    from asynctron.testing import GatedObjectClient

    root, kind = sys.argv[1:]
    client = GatedObjectClient(backend_for(root).client)
    backend = ObjectStoreBackend(client)
    point = ".metadata" if kind == "dcp" else "manifest.json"  # the first commit point
    held = client.hold("put", where=lambda url: url.key.endswith(f"/step-2/{point}"))
    state = {"w": torch.full((1 << 20,), 2.0), "v": torch.arange(2.0)}

    def ready():
        if held.wait_reached(timeout_s=120):
            print("ready", flush=True)

    threading.Thread(target=ready, daemon=True).start()
    if kind == "dcp":
        dcp.save(state, storage_writer=StorageWriter(f"{root}/step-2", backend=backend))
    else:
        async def main():
            async with Engine(backend=backend) as engine:
                await engine.save(state, f"{root}/step-2")

        uvloop.run(main())
""")


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 20,), float(step)), "v": torch.arange(float(step))}


def _save(kind: str, step: int, root: str) -> None:
    if kind == "dcp":
        dcp.save(_state(step), storage_writer=StorageWriter(f"{root}/step-{step}"))
    else:
        asynctron.save(_state(step), f"{root}/step-{step}")


def _folders(keys: list[str]) -> set[str]:
    return {key.split("/")[0] for key in keys}


@pytest.mark.parametrize("kind", ["dcp", "engine"])
def test_a_killed_savers_claim_names_nothing_and_is_swept(store: Store, kind: str) -> None:
    root = store.root
    _save(kind, 1, root)
    with subprocess.Popen([sys.executable, "-c", CHILD, root, kind], stdout=subprocess.PIPE,
                          text=True, env=os.environ | {"PYTHONPATH": os.getcwd()}) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    keys = store.keys_under(root)
    claims = [key for key in keys if key.startswith(".") and key != ".asynctron-ledger"]
    assert len(claims) == 1 and re.fullmatch(r"\.asynctron\.tmp-[0-9a-f]{16}-[0-9a-f]{16}",
                                             claims[0]), keys
    assert any(key.startswith("step-2/") for key in keys), keys  # its data, uncommitted
    marker = ".metadata" if kind == "dcp" else "manifest.json"
    steps = [int(match.group(1)) for name in _folders(keys)  # torchtitan's resume scan
             if (match := re.search(r"step-(\d+)", name)) and f"{name}/{marker}" in keys]
    assert max(steps) == 1
    if kind == "dcp":
        target: dict[str, Any] = {"w": torch.zeros(1 << 20), "v": torch.zeros(1)}
        dcp.load(target, storage_reader=StorageReader(f"{root}/step-1"))
    else:
        target = asynctron.load(root)
    assert_same(_state(1), target)

    _save(kind, 3, root)
    left = {"step-1", "step-3"} | ({"latest"} if kind == "engine" else set())
    assert _folders(store.keys_under(root)) - {".asynctron-ledger"} == left
    assert store.uploads_under(root) == []
