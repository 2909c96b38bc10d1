"""A one-rank gloo process group in the test process, for the comm unit tests (the multi-rank
tests spawn real ranks: tests/distributed/)."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def world_one() -> Iterator[None]:
    """torch.distributed initialized as rank 0 of 1 (gloo) for the test, destroyed after it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
