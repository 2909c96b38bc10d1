"""Whether a process of this host still runs: how a claim, a lock file or a temporary left by
a process is told to be a dead one's."""

from __future__ import annotations

import os


def process_exists(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
