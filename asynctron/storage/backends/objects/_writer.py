"""`ObjectWriter`: one file of a save as one object, its staged batches sent as the parts of an
upload.

Each `write` digests its batches' items on the executor (one call), then sends them: a slab of
at least the store's least part size is a part by itself, straight from its memory; smaller batches
are joined into one part (a copy of at most a few MiB). Every part of the call is in flight at
once, bounded by the client's request budget; the call returns when all of them are stored, so
the caller may reuse the slabs. A tail smaller than a part is copied and carried to the next
call. A file no larger than the config's `single_put_bytes` is one PUT.

The object appears only when its upload completes (a store never shows a part of one); until the
checkpoint's manifest is written it is not part of any checkpoint. A failed or cancelled
writer aborts its upload in `aclose`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from asynctron._concurrency import RunBlocking, first_error
from asynctron.storage.backends._write_batch import WriteBatch
from asynctron.storage.backends.objects._client import ObjectClient
from asynctron.storage.backends.objects._layout import ObjectUrl
from asynctron.storage.format import Checksums

logger = logging.getLogger(__name__)


class ObjectWriter:
    """Writes one object of a save; owned by one writer task (not safe for concurrent
    `write`s).

    Durability: the object is stored (the store acknowledged it) once the `write` that
    completes it returns.
    """

    def __init__(self, client: ObjectClient, url: ObjectUrl, nbytes: int,
                 run_blocking: RunBlocking, *, checksums: Checksums | None) -> None:
        self.url = url
        self.nbytes = nbytes
        self._client = client
        self._run_blocking = run_blocking
        self._checksums = checksums
        self._min_part = client.limits.least_part_bytes(nbytes)
        self._next_offset = 0
        self._carried: list[memoryview] = []
        """Bytes written but not yet sent (less than a part), copied: the caller's slabs are
        released after each call."""
        self._upload_id: str | None = None
        self._tags: list[str] = []
        self._done = False

    async def open(self) -> None:
        """Nothing to create yet: the upload starts with the first part."""

    @property
    def done(self) -> bool:
        """Whether the object is stored whole."""
        return self._done

    async def write(self, batches: Sequence[WriteBatch],
                    on_written: Callable[[WriteBatch], None]) -> None:
        """Digest and send `batches` (consecutive, continuing the object); `on_written(batch)`
        for each once it is stored or copied. The call that completes the object completes
        its upload.

        Raises:
            StorageError: a request failed (naming the object and the store).

        Cancellation: the requests in flight are cancelled; `aclose` aborts the upload.
        """
        for batch in batches:
            assert batch.file_offset == self._next_offset, "batches must be written in order"
            self._next_offset += batch.nbytes
        complete = self._next_offset == self.nbytes
        buffers = [buffer for batch in batches for buffer in batch.buffers()]
        pending = [*self._carried, *buffers]
        pending_bytes = sum(buffer.nbytes for buffer in pending)
        if complete and self._upload_id is None and pending_bytes <= max(
                self._client.config.single_put_bytes, 0):
            body = await self._run_blocking(_digest_and_join, self._checksums, batches, pending)
            await self._client.put(self.url, body)
            self._finish(batches, on_written)
            return
        parts, tail = _split_into_parts(pending, self._min_part, complete)
        bodies, carried = await self._run_blocking(_digest_and_prepare, self._checksums,
                                                   batches, parts, tail)
        self._carried = carried
        if bodies:
            if self._upload_id is None:
                self._upload_id = await self._client.start_upload(self.url)
            first = len(self._tags) + 1
            self._tags.extend("" for _ in bodies)
            try:
                async with asyncio.TaskGroup() as group:
                    for number, body in enumerate(bodies, first):
                        group.create_task(self._send_part(number, body))
            except BaseExceptionGroup as error:
                raise first_error(error)  # noqa: B904 (the group stays as __context__)
        if complete:
            assert self._upload_id is not None
            await self._client.complete_upload(self.url, self._upload_id, self._tags)
        self._finish(batches, on_written, complete=complete)

    async def _send_part(self, number: int, body: memoryview | bytes) -> None:
        assert self._upload_id is not None
        self._tags[number - 1] = await self._client.upload_part(self.url, self._upload_id,
                                                                number, body)

    def _finish(self, batches: Sequence[WriteBatch], on_written: Callable[[WriteBatch], None],
                *, complete: bool = True) -> None:
        for batch in batches:
            on_written(batch)
        if complete:
            self._done = True
            self._upload_id = None

    async def aclose(self) -> None:
        """Abort the upload if the object was never completed; never raises StorageError
        (a failure is logged: the next commit under the root aborts what is left)."""
        upload_id, self._upload_id = self._upload_id, None
        self._carried = []
        if upload_id is None or self._done:
            return
        try:
            await self._client.abort_upload(self.url, upload_id)
        except Exception as error:
            logger.warning("could not abort the upload of %s (the next commit under its root "
                           "does): %s", self.url, error)


def _split_into_parts(pending: list[memoryview], min_part: int, complete: bool
                      ) -> tuple[list[list[memoryview]], list[memoryview]]:
    """`pending` cut into parts of at least `min_part` bytes at buffer boundaries, and the
    tail too small for one (none when `complete`: the last part may be small). A buffer is
    never split, so a slab is one part, sent from where it lies."""
    parts: list[list[memoryview]] = []
    current: list[memoryview] = []
    size = 0
    for buffer in pending:
        current.append(buffer)
        size += buffer.nbytes
        if size >= min_part:
            parts.append(current)
            current, size = [], 0
    if current and complete:  # the last part may be small
        parts.append(current)
        current = []
    return parts, current


def _digest_and_join(checksums: Checksums | None, batches: Sequence[WriteBatch],
                     pending: Sequence[memoryview]) -> bytes:
    """Blocks: continue the items' digests over `batches`, and join `pending` into one body."""
    if checksums is not None:
        for batch in batches:
            checksums.update(batch.bodies())
    return b"".join(pending)


def _digest_and_prepare(checksums: Checksums | None, batches: Sequence[WriteBatch],
                        parts: Sequence[Sequence[memoryview]], tail: Sequence[memoryview]
                        ) -> tuple[list[memoryview | bytes], list[memoryview]]:
    """Blocks: continue the digests; each part's body (its buffer itself, else the buffers
    joined); the tail copied (it outlives the caller's slabs)."""
    if checksums is not None:
        for batch in batches:
            checksums.update(batch.bodies())
    bodies: list[memoryview | bytes] = [
        part[0].cast("B") if len(part) == 1 else b"".join(part) for part in parts]
    carried = [memoryview(b"".join(tail))] if tail else []
    return bodies, carried
