"""The torchtitan-style example (examples/dcp_train.py) trains with async DCP saves through
asynctron, resumes from its newest checkpoint restoring every value exactly, and a second run
continues from where the first stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "dcp_train.py")


def run(folder: str, out: str, *extra: str) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, EXAMPLE, "--folder", folder, "--interval", "5",
         "--json", out, *extra], capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


def test_example_trains_saves_and_resumes(tmp_path: Any) -> None:
    folder = f"{tmp_path}/ckpt"
    first = run(folder, f"{tmp_path}/a.json", "--steps", "22", "--check-resume")
    assert first["resume_exact"] is True and first["resumed_from"] is None
    assert first["steps"] == [5, 10, 15, 20, 22]
    assert first["last_loss"] < 0.5 * first["first_loss"]
    assert sorted(first["folder_entries"]) == sorted(f"step-{n}" for n in first["steps"])
    second = run(folder, f"{tmp_path}/b.json", "--steps", "25", "--sync")
    assert second["resumed_from"] == 22 and second["steps"] == [5, 10, 15, 20, 22, 25]
