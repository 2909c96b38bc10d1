"""This host's processes and boots: whether a process still runs (how a claim, a lock file or a
temporary left by a process is told to be a dead one's), and which boot of the machine this
is (how a file made before a reboot is told)."""

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


def boot_id() -> bytes:
    """This boot of the machine (16 bytes; empty where the kernel does not say): what a file
    that must not outlive a reboot records."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().encode()[:16]
    except OSError:
        return b""
