"""`PeerChannel`: awaitable point-to-point messages between the ranks of a gloo group, for bulk
bytes that go to one peer (a checkpoint's replica), beside training.

A message is a small header (a JSON object in a fixed-size frame) and, after it, the payload
buffers it announces, each sent from where it lies (a slab, a file's chunk: no copy). Messages
to one peer go one after another (a lock per peer and direction), so a header and its payload
never interleave with another task's; a receiver reads a header, then the payload it names,
into buffers of its own.

gloo gives point-to-point work no future, so each wait holds a thread of the `RunBlocking`
door while the bytes move: at most one send per destination and one receive per source at a
time. A peer that dies fails the wait at once (`PeerError`); one that hangs, after the group's
timeout.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from asynctron._concurrency import RunBlocking
from asynctron.comm._bridge import peer_error, wait_work
from asynctron.errors import PeerError

FRAME_BYTES = 4096
"""The size of a header frame: JSON, padded with spaces."""


class PeerChannel:
    """Messages to and from the other ranks of `process_group` (a dedicated gloo group).

    Args:
        process_group: the group (from `new_gloo_group`); ranks below are ranks in it.
        run_blocking: the door whose threads wait for the transfers (`engine.run_blocking`).

    Concurrency: any number of tasks may send and receive at once; messages to one peer (or
    from one) go one at a time, in the order the tasks asked.
    """

    def __init__(self, process_group: dist.ProcessGroup, *, run_blocking: RunBlocking) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._run_blocking = run_blocking
        self._sending: dict[int, asyncio.Lock] = {}
        self._receiving: dict[int, asyncio.Lock] = {}

    async def send(self, dst: int, header: dict[str, Any], payload: Sequence[memoryview] = (),
                   *, tag: int) -> None:
        """Send `header` (a JSON object of at most `FRAME_BYTES`), then each payload buffer,
        to rank `dst`; returns once the peer has them (the buffers may then be reused).

        Raises:
            PeerError: the peer is gone or late (the group's timeout).
            ValueError: the header does not fit a frame (nothing is sent).

        Cancellation: a transfer cannot be un-posted; the one in flight runs to its end, then
        the cancellation is raised (the peer then sees a message cut short: end its stream).
        """
        frame = _frame(header)
        async with self._sending.setdefault(dst, asyncio.Lock()):
            await self._transfer("send", dst, frame, tag)
            for buffer in payload:
                if buffer.nbytes:
                    await self._transfer("send", dst, _tensor(buffer), tag)

    async def receive_header(self, src: int, *, tag: int) -> dict[str, Any]:
        """The next header from rank `src`; its payload must be taken next, by
        `receive_into`, before another header.

        Raises:
            PeerError: the peer is gone or late.
        """
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        async with self._receiving.setdefault(src, asyncio.Lock()):
            await self._transfer("receive", src, frame, tag)
        return json.loads(bytes(frame.numpy()).decode())

    async def receive_into(self, src: int, buffer: memoryview, *, tag: int) -> None:
        """Fill `buffer` with the next payload buffer from rank `src` (its size must be the
        one the sender sent, as its header said).

        Raises:
            PeerError: the peer is gone or late.
        """
        if not buffer.nbytes:
            return
        async with self._receiving.setdefault(src, asyncio.Lock()):
            await self._transfer("receive", src, _tensor(buffer), tag)

    async def _transfer(self, what: str, peer: int, tensor: torch.Tensor, tag: int) -> None:
        group_peer = dist.get_global_rank(self.process_group, peer)
        try:
            if what == "send":
                work = dist.isend(tensor, group_peer, group=self.process_group, tag=tag)
            else:
                work = dist.irecv(tensor, group_peer, group=self.process_group, tag=tag)
            assert work is not None
            await wait_work(work, run_blocking=self._run_blocking)
        except (RuntimeError, dist.DistError) as error:
            if isinstance(error, PeerError):
                raise
            raise peer_error(f"{what} of {tensor.numel()} bytes with rank {group_peer}",
                             self.process_group, error) from error

    def __repr__(self) -> str:
        return f"<PeerChannel rank {self.rank} of {self.world_size}>"


def _frame(header: dict[str, Any]) -> torch.Tensor:
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > FRAME_BYTES:
        raise ValueError(f"header: expected at most {FRAME_BYTES} bytes of JSON, found "
                         f"{len(text)}; send large values as payload")
    return torch.frombuffer(bytearray(text.ljust(FRAME_BYTES)), dtype=torch.uint8)


def _tensor(buffer: memoryview) -> torch.Tensor:
    """A uint8 tensor over `buffer`'s memory (no copy)."""
    view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
    if view.readonly:  # torch would warn on a read-only buffer; gloo only reads it
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)
