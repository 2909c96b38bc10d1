"""Smoke test of `asynctron bench s3 --ranks`: a tiny job restarts from its own SeaweedFS
through a proxy per node; every method loads every layout (the run fails unless each rank's
state comes back whole) and the report counts the bytes each read from the store. Structure
and byte counts only, never speed."""

from __future__ import annotations

import json

import pytest

from asynctron.bench import _store_restarts, s3
from tests.bench.test_s3 import _missing


@pytest.mark.slow
def test_quick_restarts_read_replicated_state_once_and_report_every_method(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    if (reason := _missing()) is not None:
        pytest.skip(reason)
    out = f"{tmp_path}/restarts.json"
    assert s3.main(["--quick", "--ranks", "2", "--ranks-per-node", "1", "--out", out]) == 0
    with open(out) as f:
        results = json.load(f)
    for layout in _store_restarts.LAYOUTS:
        found = results[layout]
        assert set(found["median_s"]) == {f"{method}, {link}"
                                          for method in (*_store_restarts.METHODS,
                                                         _store_restarts.FLOOR_GETS)
                                          for link in ("proxied", "loopback")}
        read = found["store_bytes_over_state"]
        # each stored byte once for the job (the items; padding between them may be read)
        assert 1.0 <= read[f"{_store_restarts.OURS}, proxied"] < 1.1, (layout, read)
        assert 1.0 <= read[f"{_store_restarts.FLOOR}, proxied"] < 1.1, (layout, read)
    ddp = results["ddp"]["store_bytes_over_state"]
    assert ddp[f"{_store_restarts.OURS_UNSHARED}, proxied"] >= 2.0  # every rank read it all
    assert "restart from the store, 2 ranks, ddp state" in capsys.readouterr().out
