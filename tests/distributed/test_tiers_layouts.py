"""Tiers on the state large jobs hold, across real gloo ranks as 2 "nodes" of 2: FSDP2, HSDP
(replicate x shard), tensor parallel with FSDP2, and DDP, each with AdamW, its state from
`get_state_dict`. Every restore is in fresh processes and compared bit for bit, by each
tensor's whole (gathered) bytes, with the state saved: from the node's own tier, a lost node
from the other node, both nodes lost from the store, and elastically (4 ranks -> 2, 2 -> 4);
a job that loses a node mid-run resumes and repeats the uninterrupted run."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import uvloop

import asynctron
from asynctron import Engine, Tiers
from asynctron._launch import run_local_ranks
from asynctron.cli import main as cli_main
from asynctron.cli import verify_checkpoint
from asynctron.storage.format import MANIFEST_NAME, parse_manifest
from asynctron.testing.layouts import LAYOUTS, Job, build, full_digests, full_nbytes

pytestmark = pytest.mark.slow

SMALL = {"slab_bytes": 256 << 10, "memory_budget_bytes": 4 << 20}
STEPS = 4
"""Steps saved; the uninterrupted run goes two further."""


def tiers_of(root: str, layout: str) -> Tiers:
    return Tiers(local=f"{root}/{layout}/node{{node}}", store=f"{root}/{layout}/store",
                 replicas=1, store_every=2, keep_local=2)


def _state(job: Job, step: int) -> dict[str, Any]:
    return {**job.state(), "step": step}


def train_and_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every layout: train `STEPS` steps, saving each to the tiers; then two more, unsaved.
    The state's digests at `STEPS` and at `STEPS + 2`."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = "2"
    found: dict[str, Any] = {}

    async def main() -> None:
        for layout in LAYOUTS:
            job = build(layout, per_node=2)
            async with Engine(tiers=tiers_of(root, layout), **SMALL) as engine:
                for step in range(1, STEPS + 1):
                    job.train_step(step)
                    await engine.save(_state(job, step), step=step)
            saved = full_digests(job.state())
            for step in (STEPS + 1, STEPS + 2):
                job.train_step(step)
            found[layout] = {"saved": saved, "later": full_digests(job.state()),
                             "nbytes": full_nbytes(job.state())}

    uvloop.run(main())
    return found


def restore_and_resume(rank: int, world: int, root: str, per_node: int,
                       save: bool, share_reads: bool | None = None) -> dict[str, Any]:
    """Every layout: a fresh job (another seed) restores, then trains two more steps (saved
    to the tiers if `save`). What it restored (step, sources, digests, bytes read from the
    store) and the digests two steps later."""
    os.environ["ASYNCTRON_RANKS_PER_NODE"] = str(per_node)
    found: dict[str, Any] = {}

    async def main() -> None:
        for layout in LAYOUTS:
            job = build(layout, per_node=per_node, seed=7)
            job.init_optimizer_state()
            state = _state(job, -1)
            async with Engine(tiers=tiers_of(root, layout), share_reads=share_reads,
                              **SMALL) as engine:
                result = await engine.restore(state)
                job.load(result.state)
                restored = full_digests(job.state())
                for step in (result.step + 1, result.step + 2):
                    job.train_step(step)
                    if save:
                        await engine.save(_state(job, step), step=step)
            found[layout] = {"step": result.step, "sources": result.sources,
                             "values": result.state["step"], "restored": restored,
                             "store_read": result.nbytes.get("store", 0),
                             "later": full_digests(job.state())}

    uvloop.run(main())
    return found


def _ranks(target: Any, world: int, *args: Any) -> list[Any]:
    return [r.unwrap() for r in run_local_ranks(target, world, *args, timeout_s=300)]


def _check(found: list[dict[str, Any]], step: int, sources: tuple[str, ...],
           expected: dict[str, Any]) -> None:
    """Every rank restored `step` from `sources`, its whole tensors as `expected` (by
    layout)."""
    for layout in LAYOUTS:
        for rank, f in enumerate(found):
            got = f[layout]
            assert (got["step"], got["values"]) == (step, step), (layout, rank, got)
            assert got["sources"] == sources, (layout, got["sources"])
            assert got["restored"] == expected[layout], (layout, rank)


def _store_bytes(root: str, layout: str, *, items: bool = False, under: int | None = None
                 ) -> int:
    """The bytes of the data files of the store's newest step (or of its items alone, or of
    its items under `under` bytes each)."""
    store = f"{root}/{layout}/store"
    with open(f"{store}/latest") as latest:
        step = latest.read().strip()
    with open(f"{store}/{step}/{MANIFEST_NAME}", "rb") as file:
        manifest = parse_manifest(file.read(), step)
    if items or under is not None:
        return sum(record.nbytes for record in manifest.items
                   if under is None or record.nbytes < under)
    return sum(manifest.files.values())


def test_every_layout_restores_bit_for_bit_from_every_tier_and_elastically(
        tmp_path: Any) -> None:
    root = str(tmp_path)
    saved = _ranks(train_and_save, 4, root)
    for layout in LAYOUTS:  # every rank gathered the same whole tensors
        assert all(s[layout] == saved[0][layout] for s in saved), layout
    at_step = {layout: saved[0][layout]["saved"] for layout in LAYOUTS}
    later = {layout: saved[0][layout]["later"] for layout in LAYOUTS}

    # both nodes whole: each rank from its own node's tier; the run resumes as if unbroken
    found = _ranks(restore_and_resume, 4, root, 2, False)
    _check(found, STEPS, ("local",) * 4, at_step)
    assert all(f[layout]["later"] == later[layout] for f in found for layout in LAYOUTS)

    # node 1 lost with its disk: its ranks from node 0 (the replicas of what only node 1
    # held; HSDP's and DDP's replicas are node 0's own copy)
    for layout in LAYOUTS:
        shutil.rmtree(f"{root}/{layout}/node1")
    found = _ranks(restore_and_resume, 4, root, 2, False)
    _check(found, STEPS, ("local", "local", "replica", "replica"), at_step)
    assert all(f[layout]["later"] == later[layout] for f in found for layout in LAYOUTS)

    # the store holds each item once: the state's size (plus alignment), not world copies
    for layout in LAYOUTS:
        assert _store_bytes(root, layout) < 1.25 * saved[0][layout]["nbytes"], layout

    # 4 ranks -> 2 (one node; node 0's disk survives and covers the new layout); the 2-rank
    # job saves two steps of its own
    found = _ranks(restore_and_resume, 2, root, 2, True)
    _check(found, STEPS, ("local", "local"), at_step)
    two = {layout: found[0][layout]["later"] for layout in LAYOUTS}

    # 2 ranks -> 4: the new node 1 is empty; its ranks from node 0's tier
    found = _ranks(restore_and_resume, 4, root, 2, False)
    _check(found, STEPS + 2, ("local", "local", "replica", "replica"), two)

    # both nodes lost: from the store (the 2-rank job drained its step 6), on 4 ranks,
    # each rank reading its own; then each stored item read once for the job, by one of the
    # ranks that need it (replicated state too), and sent to the others (an item under 1 KiB,
    # a step count, by each rank that needs it)
    for layout in LAYOUTS:
        shutil.rmtree(f"{root}/{layout}/node0")
        shutil.rmtree(f"{root}/{layout}/node1", ignore_errors=True)
    found = _ranks(restore_and_resume, 4, root, 2, False, False)
    _check(found, STEPS + 2, ("store",) * 4, two)
    found = _ranks(restore_and_resume, 4, root, 2, False, True)
    _check(found, STEPS + 2, ("store",) * 4, two)
    for layout in LAYOUTS:
        read = [f[layout]["store_read"] for f in found]
        items, tiny = _store_bytes(root, layout, items=True), _store_bytes(root, layout,
                                                                           under=1024)
        assert items <= sum(read) <= items + 3 * tiny, (layout, read, items, tiny)
        assert sum(part > 0 for part in read) >= 2, (layout, read)  # spread over the ranks

    # the drained step is an ordinary checkpoint: one process loads it whole, stock
    # `dcp.load` reads it through the plugin, `asynctron verify` checks every item and
    # `asynctron inspect` lists it
    for layout in LAYOUTS:
        store = f"{root}/{layout}/store"
        whole = asynctron.load(store)
        into = torch.utils._pytree.tree_map(
            lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v, whole)
        dcp.load(into, storage_reader=asynctron.dcp.StorageReader(store))
        assert full_digests(into) == full_digests(whole), layout
        assert whole["step"] == into["step"] == STEPS + 2
        path, _, failures = uvloop.run(verify_checkpoint(store))
        assert failures == [] and path.endswith("step_00000006"), (layout, failures)
        assert cli_main(["inspect", store]) == 0
