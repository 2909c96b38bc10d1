"""`PeerChannel`: awaitable point-to-point messages between the ranks of a gloo group, for bulk
bytes that go to one peer (a checkpoint's replica), beside training.

A message is a small header (a JSON object in a fixed-size frame; its `sizes` list the payload
buffers) and, after it, those buffers, each sent from where it lies (a slab, a file's chunk: no
copy). Messages to one peer go one after another (a lock per peer and direction), so a header
and its payload never interleave with another task's; a receiver takes a whole message into a
buffer of its own. Each message is one thread call on each side: one loop wake-up, however many
buffers it carries.

gloo gives point-to-point work no future, so each transfer is waited for by a thread: the
channel's own (the bridge's "waiting thread" path), never the engine's executor, whose threads
the file I/O of the same saves needs (transfers last as long as the bytes take to move, and a
receiver's progress can depend on its disk writes: waiting on the engine's threads starved
them). At most one send per destination and one receive per source are in flight at a time, so
the channel holds at most two threads per peer, made when first needed. A peer that dies fails
the wait at once (`PeerError`); one that hangs, after the group's timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asynctron._concurrency import to_its_end
from asynctron.comm._bridge import peer_error

T = TypeVar("T")

FRAME_BYTES = 4096
"""The size of a header frame: JSON, padded with spaces."""


class PeerChannel:
    """Messages to and from the other ranks of `process_group` (a dedicated gloo group).

    Args:
        process_group: the group (from `new_gloo_group`); ranks below are ranks in it.

    Concurrency: any number of tasks may send and receive at once; messages to one peer (or
    from one) go one at a time, in the order the tasks asked. `close` when done.
    """

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._waiting = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, 2 * (self.world_size - 1)), thread_name_prefix="asynctron-peer")
        self._sending: dict[int, asyncio.Lock] = {}
        self._receiving: dict[int, asyncio.Lock] = {}

    async def send(self, dst: int, header: dict[str, Any], payload: Sequence[memoryview] = (),
                   *, tag: int) -> None:
        """Send `header` (a JSON object of at most `FRAME_BYTES`), then each payload buffer,
        to rank `dst`; returns once the peer has them (the buffers may then be reused). One
        thread call for the whole message.

        Raises:
            PeerError: the peer is gone or late (the group's timeout).
            ValueError: the header does not fit a frame (nothing is sent).

        Cancellation: a transfer cannot be un-posted; the message runs to its end, then the
        cancellation is raised.
        """
        tensors = [_frame(header), *(_tensor(b) for b in payload if b.nbytes)]
        peer = dist.get_global_rank(self.process_group, dst)
        async with self._sending.setdefault(dst, asyncio.Lock()):
            await self._call("send", peer, functools.partial(self._send_all, tensors, peer, tag))

    async def receive(self, src: int, into: memoryview, *, tag: int
                      ) -> tuple[dict[str, Any], int]:
        """The next message from rank `src`: its header, and its payload received into
        `into`, one buffer after another (one thread call for the whole message). Returns
        the header and how many bytes of payload `into` holds: all of it, or 0 when it does
        not fit (take it then with `receive_into`, before the next message).

        Raises:
            PeerError: the peer is gone or late.
        """
        peer = dist.get_global_rank(self.process_group, src)
        async with self._receiving.setdefault(src, asyncio.Lock()):
            return await self._call("receive", peer, functools.partial(
                self._receive_all, into, peer, tag))

    async def receive_into(self, src: int, buffers: Sequence[memoryview], *, tag: int) -> None:
        """Fill `buffers` with the pending payload of the message last received from `src`
        (their sizes must be the ones its header said).

        Raises:
            PeerError: the peer is gone or late.
        """
        peer = dist.get_global_rank(self.process_group, src)
        tensors = [_tensor(b) for b in buffers if b.nbytes]
        async with self._receiving.setdefault(src, asyncio.Lock()):
            await self._call("receive", peer, functools.partial(self._wait_all, [
                dist.irecv(t, peer, group=self.process_group, tag=tag) for t in tensors]))

    def _send_all(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> None:
        """Blocks: post every send, then wait for them all."""
        self._wait_all([dist.isend(t, peer, group=self.process_group, tag=tag)
                        for t in tensors])

    def _receive_all(self, into: memoryview, peer: int, tag: int
                     ) -> tuple[dict[str, Any], int]:
        """Blocks: the header, then (if it fits `into`) its payload."""
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        self._wait_all([dist.irecv(frame, peer, group=self.process_group, tag=tag)])
        header = json.loads(bytes(frame.numpy()).decode())
        sizes = [int(size) for size in header.get("sizes", ())]
        if sum(sizes) > into.nbytes:
            return header, 0
        works, at = [], 0
        for size in sizes:
            if size:
                works.append(dist.irecv(_tensor(into[at:at + size]), peer,
                                        group=self.process_group, tag=tag))
            at += size
        self._wait_all(works)
        return header, at

    @staticmethod
    def _wait_all(works: Sequence[dist.Work | None]) -> None:
        for work in works:
            assert work is not None
            work.wait()

    async def _call(self, what: str, peer: int, transfer: Callable[[], T]) -> T:
        """Run the blocking `transfer` on one of the channel's threads (gloo gives point-to-
        point work no future); its backend error becomes `PeerError`.

        Cancellation: the transfers cannot be un-posted; the thread finishes first."""
        try:
            return await to_its_end(
                asyncio.get_running_loop().run_in_executor(self._waiting, transfer))
        except (RuntimeError, dist.DistError) as error:
            raise peer_error(f"{what} with rank {peer}", self.process_group, error) from error

    def close(self) -> None:
        """Let the channel's threads go (their transfers are over, or fail with the group)."""
        self._waiting.shutdown(wait=False)

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

