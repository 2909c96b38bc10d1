"""A ranged GET of a signed URL (S3's presigned, Azure's SAS; GCS's, with a bearer token)
whose body lands in the caller's buffers (`RangeClient`): the read every cloud's
`ObjectClient.get_into` makes, and what its answer must hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

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
