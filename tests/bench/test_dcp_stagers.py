"""The DCP peers' stager: kept across saves where this torch's `DefaultStager` stages more than
once (2.9, 2.10, 2.13 and later), one per save where it does not (2.11 and 2.12 close it after
every stage); either way every save through the peer lands."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions

from asynctron.bench import _peers

CPU_OPTIONS = StagingOptions(False, False, False, False)


def test_the_probe_tells_a_stager_that_stages_twice() -> None:
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    assert _peers.default_stager_is_reusable() is (version not in ((2, 11), (2, 12)))


@pytest.mark.parametrize("reusable", [True, False])
def test_the_peer_saves_every_time_with_a_kept_or_a_fresh_stager(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, reusable: bool) -> None:
    monkeypatch.setattr(_peers, "default_stager_is_reusable", lambda: reusable)
    stagers = _peers.OneStagerPerSave(CPU_OPTIONS)
    seen = []
    for step in range(3):
        stager = stagers.for_save()
        seen.append(stager)
        state = {"w": torch.full((4,), float(step))}
        dcp.async_save(state, checkpoint_id=f"{tmp_path}/s{step}", async_stager=stager,
                       no_dist=True).result()
        loaded = {"w": torch.zeros(4)}
        dcp.load(loaded, checkpoint_id=f"{tmp_path}/s{step}", no_dist=True)
        assert torch.equal(loaded["w"], state["w"])
    stagers.close()
    assert (len({id(stager) for stager in seen}) == 1) is reusable
