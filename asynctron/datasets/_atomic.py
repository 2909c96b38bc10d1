"""Writing a file whole or not at all: write to a temporary name beside it, then rename."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import IO


def write_atomically(path: str, write: Callable[[IO[bytes]], object],
                     buffering: int = -1) -> None:
    """Call `write(f)` on a new file and publish it as `path`, durably: after a crash `path`
    is either the old file or the whole new one. On any error the temporary file is removed
    and `path` is untouched. Blocking call."""
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb", buffering=buffering) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
