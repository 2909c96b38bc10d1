"""What `asynctron demo` leaves on disk: by default a fresh directory under `./demo-out`,
removed once the run has passed (its checkpoints are hundreds of MiB, and a demo's output is
of no use after it); kept where the run failed, or where the user named it (`--out`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

DEFAULT_PARENT = "demo-out"


def fresh_output_dir() -> str:
    """A new directory `./demo-out/<timestamp>-*` (the parent made if needed)."""
    os.makedirs(DEFAULT_PARENT, exist_ok=True)
    return tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=DEFAULT_PARENT)


def disk_nbytes(path: str) -> int:
    """The bytes the files under `path` take on disk (as `du` counts them: allocated blocks,
    each hard link once)."""
    seen: set[tuple[int, int]] = set()
    nbytes = 0
    for root, _, names in os.walk(path):
        for name in names:
            stat = os.lstat(os.path.join(root, name))
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                nbytes += stat.st_blocks * 512
    return nbytes


def remove_output_dir(path: str) -> None:
    """Remove `path`, and `./demo-out` with it when nothing else is left there."""
    shutil.rmtree(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.abspath(parent) == os.path.abspath(DEFAULT_PARENT) and not os.listdir(parent):
        os.rmdir(parent)
