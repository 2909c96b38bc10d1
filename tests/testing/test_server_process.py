"""The test servers' one launcher: it waits until the server answers, sets it up, stops it;
a server that exits or never answers is stopped and named with its log's tail."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from asynctron.testing._server_process import ServerProcess, answers_http, free_port

_SERVE = """
import http.server, sys
class Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(204); self.end_headers()
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Quiet).serve_forever()
"""


@dataclass
class _Tiny(ServerProcess):
    """A Python one-liner server: answers any GET once it listens."""

    endpoint: str
    set_up: list[str] = field(default_factory=list)
    server_name = "tiny"
    ready_timeout_s = 60.0

    @classmethod
    def start(cls, tmp_path: Path, code: str) -> _Tiny:
        port = free_port()
        return cls._launch([sys.executable, "-c", code, str(port)], str(tmp_path / "tiny.log"),
                           endpoint=f"http://127.0.0.1:{port}")

    def _answers(self) -> bool:
        return answers_http(self.endpoint + "/")

    def _set_up(self) -> None:
        assert self._answers()
        self.set_up.append("bucket")


class _Mute(_Tiny):
    """Never answers (it listens on no port); the launcher gives up once its log says it is
    up, and `probed` keeps it for the test."""

    ready_timeout_s = 0.0
    probed: ClassVar[list[_Mute]] = []

    def _answers(self) -> bool:
        self.probed.append(self)
        deadline = time.monotonic() + 30
        while b"still booting" not in Path(self.log_path).read_bytes():  # wait for its line
            assert time.monotonic() < deadline, "the child never logged"
            time.sleep(0.01)
        return False


def test_start_waits_until_it_answers_and_sets_it_up(tmp_path: Path) -> None:
    with _Tiny.start(tmp_path, _SERVE) as server:
        assert server.set_up == ["bucket"]
        assert answers_http(server.endpoint + "/")
    assert server.process.returncode is not None
    assert not answers_http(server.endpoint + "/")
    server.stop()  # again: nothing


def test_a_server_that_exits_is_named_with_its_log_tail(tmp_path: Path) -> None:
    code = "import sys; print('bad flag -x', flush=True); sys.exit(3)"
    with pytest.raises(RuntimeError, match=r"^tiny \(pid \d+\): expected it to answer within "
                       r"60 s, found it exited with 3; see its log .*tiny\.log, which ends:\n"
                       r"bad flag -x\n$"):
        _Tiny.start(tmp_path, code)


def test_a_server_that_never_answers_is_stopped(tmp_path: Path) -> None:
    code = "import time; print('still booting', flush=True); time.sleep(600)"
    with pytest.raises(RuntimeError, match=r"found no answer; .*which ends:\nstill booting\n$"):
        _Mute.start(tmp_path, code)
    server = _Mute.probed[-1]
    assert all(probed is server for probed in _Mute.probed)
    assert server.process.returncode is not None  # stopped before the error came up
