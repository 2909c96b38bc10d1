"""A ranged GET of a signed URL (S3's presigned, Azure's SAS; GCS's, with a bearer token)
whose body lands in the caller's buffers (`RangeClient`): the read every cloud's
`ObjectClient.get_into` makes, and what its answer must hold; and `SignedUrls`, the URLs it
reads, signed once per object; `error_document`, what a failed answer's XML body says.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from asynctron.errors import CorruptCheckpointError, StorageError
from asynctron.storage.backends.objects._http_ranges import RangeClient
from asynctron.storage.backends.objects._layout import ObjectUrl


async def signed_get_into(ranges: RangeClient, signed_url: str, url: ObjectUrl, endpoint: str,
                          offset: int, buffers: Sequence[memoryview], *, key: str | None,
                          if_match: str | None,
                          error_of: Callable[[int, bytes], Exception],
                          headers: Mapping[str, str] | None = None) -> None:
    """One try: fill `buffers` with `url`'s bytes from `offset` by a GET of `signed_url`
    (with `If-Match: if_match`, if given, and `headers`: a bearer token).

    Raises:
        error_of(status, body): the store answered other than 200 or 206.
        CorruptCheckpointError: the object ends before the buffers are full (names `key`,
            the item being read; without one, a StorageError).
        StorageError: the store ignored the range.
    """
    nbytes = sum(buffer.nbytes for buffer in buffers)
    sent = {**(headers or {}), "Range": f"bytes={offset}-{offset + nbytes - 1}"}
    if if_match is not None:
        sent["If-Match"] = if_match
    answer = await ranges.get_into(signed_url, sent, buffers)
    if answer.status not in (200, 206):
        raise error_of(answer.status, answer.body)
    if answer.status == 200 and (answer.content_length or 0) > nbytes:
        raise StorageError(
            f"GET {url} at {endpoint}: asked for bytes [{offset}, +{nbytes}), sent "
            f"{answer.content_length}: the store ignored the range", path=str(url), errno=None)
    if answer.received < nbytes:
        message = (f"object {url}: expected {nbytes} bytes from offset {offset}, found "
                   f"{answer.received}")
        if key is None:
            raise StorageError(message, path=str(url), errno=None)
        raise CorruptCheckpointError(
            f"{message}; the object is shorter than its manifest says (truncated or replaced "
            "after commit)", path=str(url), key=key, offset=offset + answer.received)


def error_document(status: int, body: bytes) -> tuple[str, str]:
    """The code and the message of a failed answer's XML error document (S3's, Azure's);
    without one, the status and the body's first 200 characters."""
    text = body.decode("utf-8", "replace")
    code = re.search(r"<Code>([^<]*)</Code>", text)
    message = re.search(r"<Message>([^<]*)</Message>", text)
    return code[1] if code else str(status), message[1] if message else text[:200]


class SignedUrls:
    """Each object's signed GET URL, made by `sign` and made again when half of `life_s` is
    gone; at most `most` kept (beyond, all are dropped). Of one event loop."""

    def __init__(self, sign: Callable[[ObjectUrl], Awaitable[str]], *, life_s: float,
                 most: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:
        self._sign = sign
        self._life_s = life_s
        self._most = most
        self._clock = clock
        self._made: dict[ObjectUrl, tuple[str, float]] = {}

    async def get(self, url: ObjectUrl) -> str:
        """`url`'s signed URL, signed again where it is past half its life."""
        found = self._made.get(url)
        now = self._clock()
        if found is None or now - found[1] > self._life_s / 2:
            if len(self._made) >= self._most:
                self._made.clear()
            found = self._made[url] = (await self._sign(url), now)
        return found[0]

    def forget(self, url: ObjectUrl) -> None:
        """Sign `url` again at its next `get` (its signer's credentials were refused)."""
        self._made.pop(url, None)
