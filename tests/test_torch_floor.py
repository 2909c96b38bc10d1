"""CI's oldest-torch leg tests the floor the package declares: the Makefile's `TORCH_OLDEST` is
pyproject.toml's `torch>=`."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def test_the_makefiles_oldest_torch_is_the_declared_floor() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (floor,) = [d.removeprefix("torch>=") for d in dependencies if re.match(r"torch\b", d)]
    pin = re.search(r"^TORCH_OLDEST \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert pin is not None, "Makefile: expected a line 'TORCH_OLDEST ?= torch==X'"
    assert Version(pin[1]) == Version(floor)
