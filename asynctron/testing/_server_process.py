"""What every test server (SeaweedFS, Azurite, fake-gcs-server) does alike: a free port, a
process in a session of its own logging to a file, and a stop that waits, then kills."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from typing import Self

STOP_TIMEOUT_S = 5.0


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: Sequence[str], log_path: str) -> subprocess.Popen[bytes]:
    """`command` in a new session (so `stop_server` ends all it starts), its output appended
    to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


class ServerProcess:
    """A running test server whose `process` leads its session: `stop()` (or leaving the
    `with`) SIGTERMs the session and waits for the exit, SIGKILL after `STOP_TIMEOUT_S`;
    stopping again does nothing."""

    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
