"""Writing a file whole or not at all: write to a temporary name beside it, then rename."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO


def write_atomically(path: str, write: Callable[[IO[bytes]], object],
                     buffering: int = -1) -> None:
    """Call `write(f)` on a new file and rename it to `path`; on any error the temporary file
    is removed and `path` is untouched. Blocking call."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb", buffering=buffering) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
