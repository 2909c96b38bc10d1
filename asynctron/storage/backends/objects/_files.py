"""The file half of `ObjectStoreBackend`: whole objects published atomically, read at offsets.

Every call blocks its thread (datasets call them from worker processes and builders) while
the requests run on the process's store I/O loop, so many ranges of one object can be in flight
at once (`ObjectFile.fetch`). An object is read at the version it had when opened (each GET
carries `If-Match` with its version tag), so a reader never mixes two versions of a replaced object.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
from collections.abc import Callable, Coroutine, Sequence
from typing import IO, Any, TypeVar

from asynctron.errors import ObjectNotFoundError, StorageError
from asynctron.storage.backends.objects._client import ObjectClient, PreconditionFailedError
from asynctron.storage.backends.objects._io_loop import blocking, io_loop, one_operation
from asynctron.storage.backends.objects._layout import ObjectUrl, parse_url

T = TypeVar("T")

MiB = 1 << 20
#: the parts of an object written piece by piece (`open_new_file`): the first 1000 are this
#: size, each next 1000 twice the one before (10,000 parts: 5 TiB and more)
_FIRST_PART_BYTES = 16 * MiB
#: parts of a new object sent while the writer goes on (their memory: up to this many parts)
_PARTS_IN_FLIGHT = 4


def object_url(client: ObjectClient, path: str) -> ObjectUrl:
    url = parse_url(path, client.schemes)
    if not url.key or url.key.endswith("/"):
        raise IsADirectoryError(f"{path!r}: expected an object ({url.scheme}://bucket/key), "
                                "found a bucket or folder")
    return url


class ObjectFile:
    """An object opened for reads at given offsets: a `ReadableFile`, plus `fetch` (many
    ranges in flight at once). Reads from several threads at once are safe.

    Raises (every read):
        ObjectChangedError: the object was replaced since it was opened.
        StorageError: the store failed past the deadline (naming endpoint, object, range).
    """

    def __init__(self, client: ObjectClient, url: ObjectUrl, nbytes: int, etag: str) -> None:
        self.client = client
        self.url = url
        self.nbytes = nbytes
        self.etag = etag

    @classmethod
    def open(cls, client: ObjectClient, path: str) -> ObjectFile:
        """Blocks: the object `path`, its size and version tag from one HEAD.

        Raises:
            ObjectNotFoundError: no such object or bucket (a FileNotFoundError; the message
                names endpoint, bucket and key).
            IsADirectoryError: `path` names a bucket or a folder.
            StorageError: any other failure.
        """
        url = object_url(client, path)
        try:
            head = blocking(client.head(url))
        except ObjectNotFoundError as error:
            raise ObjectNotFoundError(f"{error}; expected an object at {path}",
                                      path=str(url)) from error
        return cls(client, url, head.size, head.etag)

    def _where(self, offset: int, nbytes: int) -> str:
        return f"{self.url} bytes [{offset}, {offset + nbytes})"

    async def _get_into(self, offset: int, buffer: memoryview) -> None:
        where = self._where(offset, buffer.nbytes)
        try:
            await self.client.get_into(self.url, offset, [buffer], if_match=self.etag)
        except PreconditionFailedError as error:
            raise ObjectChangedError(
                f"{where}: the object was replaced since it was opened (version {self.etag} no "
                "longer matches); reopen it to read the new one", path=str(self.url),
                errno=None) from error
        except StorageError as error:
            raise StorageError(f"reading {where}: {error}", path=str(self.url),
                               errno=error.errno) from error

    def pread(self, nbytes: int, offset: int) -> bytes:
        """Blocks: up to `nbytes` bytes from `offset` (fewer at the object's end); one GET."""
        nbytes = max(0, min(nbytes, self.nbytes - offset))
        if nbytes == 0:
            return b""
        buffer = bytearray(nbytes)
        blocking(self._get_into(offset, memoryview(buffer)))
        return bytes(buffer)

    def pread_into(self, buffer: memoryview, offset: int) -> int:
        """Blocks: fill `buffer` from `offset` (one GET); returns the bytes read, fewer only
        at the object's end."""
        nbytes = max(0, min(buffer.nbytes, self.nbytes - offset))
        if nbytes:
            blocking(self._get_into(offset, buffer.cast("B")[:nbytes]))
        return nbytes

    def fetch(self, ranges: Sequence[tuple[int, memoryview]]
              ) -> concurrent.futures.Future[None]:
        """Start filling each `buffer` with the bytes from its `offset` (one GET each, all in
        flight at once, within the client's request budget); returns at once. The future
        settles when every buffer is full, or with the first error."""
        async def fetch_all() -> None:
            async with asyncio.TaskGroup() as group:
                for offset, buffer in ranges:
                    group.create_task(self._get_into(offset, buffer))

        return io_loop().submit(one_operation(_first_error_of(fetch_all())))

    def close(self) -> None:
        """Nothing to release (connections belong to the client)."""

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ObjectChangedError(StorageError):
    """An object was replaced while a reader held it open."""


async def _first_error_of(coroutine: Coroutine[Any, Any, None]) -> None:
    try:
        await coroutine
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None


class NewObject:
    """An object written piece by piece and stored whole by `publish` (a `NewFile`): full
    parts are sent while the writer goes on (multipart upload); nothing is visible before
    `publish`, and `close` without it aborts the upload. One thread at a time."""

    def __init__(self, client: ObjectClient, path: str) -> None:
        self.client = client
        self.url = object_url(client, path)
        self._pending = bytearray()
        self._upload_id: str | None = None
        self._tags: list[str] = []
        self._sending: list[concurrent.futures.Future[None]] = []
        self._closed = False

    def _part_bytes(self) -> int:
        return _FIRST_PART_BYTES << (len(self._tags) // 1000)

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self._pending += view
        while len(self._pending) >= self._part_bytes():
            size = self._part_bytes()
            part, self._pending = bytes(self._pending[:size]), self._pending[size:]
            self._send(part)
        return view.nbytes

    def _send(self, part: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = blocking(self.client.start_upload(self.url))
        number = len(self._tags) + 1
        self._tags.append("")
        while len(self._sending) >= _PARTS_IN_FLIGHT:
            self._sending.pop(0).result()
        self._sending.append(io_loop().submit(self._send_part(number, part)))

    async def _send_part(self, number: int, part: bytes) -> None:
        assert self._upload_id is not None
        self._tags[number - 1] = await self.client.upload_part(self.url, self._upload_id,
                                                               number, part)

    def publish(self, *, sync_dir: bool = True) -> None:
        """Store what was written as the object (one PUT, or the upload completed); on error
        nothing is stored and the upload is aborted."""
        try:
            if (self._upload_id is None
                    and len(self._pending) <= self.client.config.single_put_bytes):
                blocking(self.client.put(self.url, self._pending))
            else:
                if self._pending or not self._tags:
                    self._send(bytes(self._pending))
                for sending in self._sending:
                    sending.result()
                assert self._upload_id is not None
                blocking(self.client.complete_upload(self.url, self._upload_id, self._tags))
                self._upload_id = None
        finally:
            self.close()

    def close(self) -> None:
        """Discard what was written unless published (the upload aborted)."""
        if self._closed:
            return
        self._closed = True
        self._pending = bytearray()
        for sending in self._sending:
            sending.cancel()
        concurrent.futures.wait(self._sending)
        upload_id, self._upload_id = self._upload_id, None
        if upload_id is not None:
            blocking(self.client.abort_upload(self.url, upload_id))

    def __enter__(self) -> NewObject:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def put_object(client: ObjectClient, url: ObjectUrl, data: bytes | memoryview) -> None:
    """Blocks: store `data` as the object `url`: one PUT up to the client's single-PUT size,
    else a multipart upload with its parts in flight together."""
    view = memoryview(data).cast("B")
    with NewObject(client, str(url)) as new:
        for start in range(0, view.nbytes, _FIRST_PART_BYTES):
            new.write(view[start:start + _FIRST_PART_BYTES])
        new.publish()


def publish_with(client: ObjectClient, path: str, write: Callable[[IO[bytes]], object]
                 ) -> None:
    """Blocks: store what `write(f)` writes to `f` as the object `path` (atomically: the
    object is its old self or all of the new one)."""
    out = io.BytesIO()
    write(out)
    put_object(client, object_url(client, path), out.getbuffer())


def remove(client: ObjectClient, path: str) -> None:
    """Blocks: delete the object `path` (none there is not an error)."""
    blocking(client.delete([object_url(client, path)]))
