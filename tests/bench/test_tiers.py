"""Smoke test: the tiers benchmark starts its own SeaweedFS and a remote-store proxy per node,
spawns 2 ranks as 2 nodes holding FSDP2 state, runs every measure once at a tiny size (each
restore checked bit for bit: the run fails otherwise) and writes its JSON with every target's
ratio. Structure only, never speed."""

from __future__ import annotations

import json
import os

import pytest

from asynctron.bench import tiers
from tests.conftest import skip_without_seaweedfs


@pytest.mark.slow
def test_quick_run_measures_every_tier_and_writes_the_targets(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    skip_without_seaweedfs()
    out = f"{tmp_path}/tiers.json"
    assert tiers.main(["--quick", "--target", str(tmp_path), "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    assert results["replica_sources"] == ["local", "replica"]
    assert set(tiers.TARGETS) <= set(results["ratios"])
    for name in ("restore local", "restore replica", "restore store", "drain",
                 "direct save to the store", "restore store, proxied",
                 "elastic restore from the store", "load_into of the same checkpoint",
                 "accelerated trainer, saving every step", "cpu trainer, saving every step"):
        assert results["median_s"][name] > 0, name
    held = results["notes"]["tier bytes"]
    assert held["ddp"]["store"] >= held["ddp"]["state"] > 0
    printed = capsys.readouterr().out
    assert "(target <= 1.1:" in printed and "replica sources: ['local', 'replica']" in printed
    assert [name for name in os.listdir(str(tmp_path)) if name.startswith("asynctron-bench")
            ] == []  # its scratch directory is gone
