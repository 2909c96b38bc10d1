"""The one launcher every test server (SeaweedFS, Azurite, fake-gcs-server) shares: a free
port, a process in a session of its own logging to a file, a wait until it answers, its
set-up (a bucket, a container), and a stop that waits, then kills.

An emulator is a `ServerProcess` subclass that keeps only what is its own: the command line
(passed to `_launch`), the readiness probe (`_answers`) and the set-up (`_set_up`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

STOP_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 60.0
_LOG_TAIL_BYTES = 2000


def find_binary(name: str, preferred: str | None, *, where: str, install: str) -> str:
    """The executable `preferred` (where the test extra puts it), else `name` on PATH.

    Raises:
        FileNotFoundError: neither, naming `where` it was looked for and how to `install` it.
    """
    if preferred is not None and os.access(preferred, os.X_OK):
        return os.path.abspath(preferred)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"`{name}`: expected it {where} or on PATH, found neither; "
                                f"{install}")
    return found


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(command: Sequence[str], log_path: str) -> subprocess.Popen[bytes]:
    """`command` in a new session (so `ServerProcess.stop` ends all it starts), its output
    appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def answers_http(url: str) -> bool:
    """Whether an HTTP server answers a GET of `url` now (any status is an answer; a refused
    or timed-out connection is not)."""
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def log_tail(log_path: str, nbytes: int = _LOG_TAIL_BYTES) -> str:
    """The last `nbytes` of the log at `log_path` (decoded leniently; empty if unreadable)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, os.fstat(log.fileno()).st_size - nbytes))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


@dataclass
class ServerProcess:
    """A running test server whose `process` leads its session, logging to `log_path`.
    `stop()` (or leaving the `with`) SIGTERMs the session and waits for the exit, SIGKILL
    after `STOP_TIMEOUT_S`; stopping again does nothing.

    Subclasses (dataclasses adding their own fields: an endpoint, a bucket) name the server
    in `server_name`, probe it in `_answers` and set it up in `_set_up`; their `start` calls
    `_launch`.
    """

    server_name: ClassVar[str] = "server"
    ready_timeout_s: ClassVar[float] = READY_TIMEOUT_S
    """How long `_launch` waits for `_answers` before it gives up."""
    poll_interval_s: ClassVar[float] = 0.1
    """How often `_launch` probes while it waits (a probe's own pace, not an ordering)."""
    process: subprocess.Popen[bytes]
    log_path: str
    """The file the server's stdout and stderr go to."""

    @classmethod
    def _launch(cls, command: Sequence[str], log_path: str, **fields: Any) -> Self:
        """Start `command` (output to `log_path`), build the server from `fields`, wait until
        it answers, and set it up; on any failure, stop it before raising.

        Raises:
            RuntimeError: it exited, or did not answer within `ready_timeout_s`; the message
                names its log and ends with the log's tail.
        """
        process = start_server(command, log_path)
        server = cls(process=process, log_path=log_path, **fields)
        try:
            server._wait_ready()
            server._set_up()
        except BaseException:
            server.stop()
            raise
        return server

    def _answers(self) -> bool:
        """Whether the server answers now (the readiness probe)."""
        raise NotImplementedError

    def _set_up(self) -> None:
        """Make what tests expect once `start` returns (a bucket, a container)."""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._answers():
            if self.process.poll() is not None:
                found = f"it exited with {self.process.returncode}"
            elif time.monotonic() > deadline:
                found = "no answer"
            else:
                time.sleep(self.poll_interval_s)
                continue
            raise RuntimeError(
                f"{self.server_name} (pid {self.process.pid}): expected it to answer within "
                f"{self.ready_timeout_s:g} s, found {found}; see its log {self.log_path}, "
                f"which ends:\n{log_tail(self.log_path)}")

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
