"""`S3Backend`: checkpoints on an S3-compatible object store, asyncio-native.

The commit protocol on a store (layout in `_layout`):
1. `start_save` refuses a committed checkpoint, then writes the save's *claim* beside it (a
   conditional PUT); a second live claim for the same checkpoint makes the later save back off.
2. Each rank's writers upload their data objects at their final keys (`ObjectWriter`). No
   manifest yet: no checkpoint.
3. `commit`: the ledger entry (with `keep_last`), then `manifest.json` (and DCP's `.metadata`)
   with If-None-Match: the commit point, exactly once. Then `latest`, pruning (a pruned
   checkpoint loses its manifest first, so it is never half there), the debris of dead saves,
   and the claim.
A save that fails is `discard`ed: its uploads aborted, its objects deleted, its claim removed.
A save that dies leaves its claim; the next commit under the root finds it dead (its process
gone, on this host; older than `S3Config.abandoned_after_s`, elsewhere) and deletes what it
names. Retention deletes only what the ledger says its job committed, as locally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO

from asynctron._concurrency import RunBlocking
from asynctron._processes import process_exists
from asynctron.errors import StorageError
from asynctron.storage._checksum import Checksums
from asynctron.storage._dcp import METADATA_NAME
from asynctron.storage._manifest import MANIFEST_NAME
from asynctron.storage.backends._backend import Committed, Retention, SaveArea
from asynctron.storage.backends._ledger import (
    LEDGER_NAME,
    MAX_LEDGER_BYTES,
    LedgerEntry,
    beyond_keep_last,
    encode_ledger,
    parse_ledger,
)
from asynctron.storage.backends.s3._client import (
    ObjectNotFoundError,
    PreconditionFailedError,
    S3Client,
)
from asynctron.storage.backends.s3._config import S3Config
from asynctron.storage.backends.s3._files import (
    NewObject,
    ObjectFile,
    publish_with,
    read_whole,
    remove,
)
from asynctron.storage.backends.s3._layout import (
    LATEST_NAME,
    Listing,
    ObjectUrl,
    claim_name,
    claimed_checkpoint,
    is_checkpoint_name,
    list_folder,
    parse_url,
)
from asynctron.storage.backends.s3._reader import ObjectReader
from asynctron.storage.backends.s3._writer import ObjectWriter

logger = logging.getLogger(__name__)

_COMMIT_POINTS = (MANIFEST_NAME, METADATA_NAME)
"""A checkpoint is committed once one of these exists in it."""
_SAVE_TOKEN = "asynctron-save"
"""The user metadata on a manifest naming the save that wrote it (the ledger's identity)."""
_LEDGER_ATTEMPTS = 8
_DELETE_BATCH = 1000
_LIVE_CLAIMS: set[str] = set()
"""The claims of this process's saves in progress, by URL (every backend object's)."""


class S3Backend:
    """Checkpoints on an S3-compatible store, through one `S3Client` (requests on the S3 I/O
    loop, a request budget, retries inside a deadline).

    Datasets cannot live here yet: the file half of `Backend` refuses every call with a
    ValueError saying so.
    Concurrency: one backend serves any number of saves and loads at once, on any loops.
    """

    def __init__(self, config: S3Config | None = None) -> None:
        self.config = config or S3Config()
        self.client = S3Client(self.config)

    def locate(self, path: str | os.PathLike[str]) -> str:
        return str(parse_url(os.fspath(path)))

    def area_of(self, final_path: str, name: str | None = None) -> SaveArea:
        url = _checkpoint_url(final_path)
        return SaveArea(final_path, str(url.parent.child(claim_name(url.name, name))))

    async def start_save(self, run_blocking: RunBlocking, area: SaveArea) -> None:
        url = _checkpoint_url(area.final_path)
        claim = parse_url(area.location)
        found = await list_folder(self.client, url)
        if any(name in found.sizes for name in _COMMIT_POINTS):
            raise FileExistsError(
                f"checkpoint {url}: expected a new path, found a committed checkpoint; save to "
                "a new path (e.g. one per step) or remove it first")
        body = json.dumps({"checkpoint": url.name, "host": socket.gethostname(),
                           "pid": os.getpid()}).encode()
        try:
            await self._put(claim, body, IfNoneMatch="*")
        except PreconditionFailedError:  # a named area (DCP's): a save before us left it
            if await self._claim_is_live(claim, None):
                raise FileExistsError(
                    f"checkpoint {url}: another save to this path is in progress (it holds "
                    f"{claim}); save to a new path") from None
            await self._put(claim, body)
        _LIVE_CLAIMS.add(str(claim))
        try:
            await self._settle_rivals(url, claim, found)
        except BaseException:
            _LIVE_CLAIMS.discard(str(claim))
            await self._delete_quietly([claim])
            raise

    async def _settle_rivals(self, url: ObjectUrl, claim: ObjectUrl, found: Listing) -> None:
        """Back off if another live save claims `url`; delete what dead saves to it left."""
        root = await list_folder(self.client, url.parent)
        rivals = [url.parent.child(name) for name in root.sizes
                  if name != claim.name and claimed_checkpoint(name) == url.name]
        dead = []
        for rival in rivals:
            if await self._claim_is_live(rival, root):
                raise FileExistsError(f"checkpoint {url}: another save to this path is in "
                                      f"progress (it holds {rival}); save to a new path")
            dead.append(rival)
        if found.sizes and not dead:
            raise FileExistsError(
                f"checkpoint {url}: expected a new path, found objects no save claims "
                f"({sorted(found.sizes)[:3]}); remove them or save to a new path")
        if dead:
            await self._remove_debris(url)
            await self._delete_quietly(dead)

    def open_writer(self, run_blocking: RunBlocking, area: SaveArea, name: str, nbytes: int, *,
                    direct_io: bool, checksums: Checksums | None) -> ObjectWriter:
        return ObjectWriter(self.client, _checkpoint_url(area.final_path).child(name), nbytes,
                            run_blocking, checksums=checksums)

    async def is_in_memory(self, run_blocking: RunBlocking, area: SaveArea) -> bool:
        return False

    async def commit(self, run_blocking: RunBlocking, area: SaveArea,
                     files: Callable[[], Mapping[str, bytes]], *, retention: Retention | None,
                     seq: int, move_latest: bool) -> Committed:
        url = _checkpoint_url(area.final_path)
        root = url.parent
        contents = await run_blocking(files)
        token = secrets.token_hex(16)
        if retention is not None:
            entry = LedgerEntry(retention.job, url.name, retention.engine, seq, token)
            await self._update_ledger(root, lambda entries: [*entries, entry])
        points = [name for name in contents if name in _COMMIT_POINTS]
        for name in [name for name in contents if name not in _COMMIT_POINTS] + points:
            try:
                await self._put(url.child(name), contents[name], IfNoneMatch="*",
                                Metadata={_SAVE_TOKEN: token})
            except PreconditionFailedError:
                raise FileExistsError(f"checkpoint {url}: another save committed it meanwhile; "
                                      "nothing of this save is committed") from None
        warnings: list[str] = []
        moved = False
        if move_latest:
            try:
                await self._put(root.child(LATEST_NAME), url.name.encode())
                moved = True
            except StorageError as error:
                warnings.append(f"checkpoint {url} is committed, but `latest` was not moved to "
                                f"it: {error}")
        pruned: list[str] = []
        try:
            if retention is not None:
                pruned = await self._prune(root, retention)
            await self._sweep(root)
        except StorageError as error:
            warnings.append(f"checkpoint {url} is committed, but pruning older ones and "
                            f"removing debris failed: {error}")
        _LIVE_CLAIMS.discard(area.location)
        await self._delete_quietly([parse_url(area.location)])
        return Committed(moved, tuple(pruned), tuple(warnings))

    async def discard(self, run_blocking: RunBlocking, area: SaveArea) -> None:
        if area.location not in _LIVE_CLAIMS:
            return
        url = _checkpoint_url(area.final_path)
        try:
            found = await list_folder(self.client, url)
            if not any(name in found.sizes for name in _COMMIT_POINTS):
                await self._remove_debris(url)
        except StorageError as error:
            logger.warning("could not remove the objects of a save that did not commit (the "
                           "next commit under %s does): %s", url.parent, error)
        _LIVE_CLAIMS.discard(area.location)
        await self._delete_quietly([parse_url(area.location)])

    async def open_reader(self, run_blocking: RunBlocking, path: str, *,
                          max_files_at_once: int) -> ObjectReader:
        return ObjectReader(self.client, path, run_blocking,
                            max_files_at_once=max_files_at_once)

    async def list_checkpoints(self, run_blocking: RunBlocking, root: str) -> list[str]:
        """One listing of every object under `root` (paged), kept to the checkpoints whose
        commit point is there."""
        folder = parse_url(root)
        names: set[str] = set()
        params = {"Bucket": folder.bucket, "Prefix": folder.prefix}
        while True:
            page = await self.client.call("list_objects_v2", folder, **params)
            for entry in page.get("Contents", ()):
                name, _, rest = entry["Key"][len(folder.prefix):].partition("/")
                if rest in _COMMIT_POINTS and is_checkpoint_name(name):
                    names.add(name)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(names)
            params["ContinuationToken"] = token

    async def remove_checkpoint(self, run_blocking: RunBlocking, path: str) -> bool:
        """Its commit points first (it stops being a checkpoint), then every object in it.
        No lease on a store: a load reading it fails clearly (a missing object)."""
        checkpoint = _checkpoint_url(path)
        found = await list_folder(self.client, checkpoint)
        if not any(name in found.sizes for name in _COMMIT_POINTS):
            return False
        await self._delete([checkpoint.child(name) for name in _COMMIT_POINTS])
        await self._remove_debris(checkpoint)
        return True

    # -- retention and debris ---------------------------------------------------------------

    async def _update_ledger(self, root: ObjectUrl,
                             change: Callable[[list[LedgerEntry]], list[LedgerEntry]]) -> None:
        """Replace the ledger with `change(entries)`, by a conditional PUT (retried when
        another commit changed it meanwhile)."""
        ledger = root.child(LEDGER_NAME)
        for _ in range(_LEDGER_ATTEMPTS):
            entries, etag = await self._read_ledger(ledger)
            condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
            try:
                await self._put(ledger, encode_ledger(change(entries)), **condition)
                return
            except PreconditionFailedError:
                continue
        raise StorageError(f"ledger {ledger}: changed by others {_LEDGER_ATTEMPTS} times while "
                           "this commit updated it; is something rewriting it in a loop?",
                           path=str(ledger), errno=None)

    async def _read_ledger(self, ledger: ObjectUrl) -> tuple[list[LedgerEntry], str | None]:
        try:
            data, etag, _ = await self.client.get_small(ledger, MAX_LEDGER_BYTES)
        except ObjectNotFoundError:
            return [], None
        if data is None:
            logger.warning("ledger %s: larger than %d bytes; ignored (nothing is pruned)",
                           ledger, MAX_LEDGER_BYTES)
            return [], etag
        return parse_ledger(data, str(ledger), is_checkpoint_name), etag

    async def _prune(self, root: ObjectUrl, retention: Retention) -> list[str]:
        """Delete this job's checkpoints beyond `keep_last` (never what `latest` names, never
        one whose manifest is not the one recorded: such an entry, a save that never
        committed or a replaced checkpoint, is dropped first and never counted), and finish
        prunings that died midway;
        returns the URLs pruned.

        Crash-safe: the doomed are marked `pruning` in the ledger first (while their manifests
        are known to be ours), then lose their manifests, then the rest; a pruner killed
        anywhere leaves marked entries, which the next one finishes."""
        entries, _ = await self._read_ledger(root.child(LEDGER_NAME))
        latest = await self._read_small(root.child(LATEST_NAME))
        keep = latest.decode(errors="replace").strip() if latest is not None else None
        unfinished = [entry for entry in entries if entry.pruning]
        dropped = [entry for entry in entries if not entry.pruning and entry.job == retention.job
                   and await self._manifest_token(root.child(entry.name)) != entry.manifest]
        committed = [entry for entry in entries if entry not in dropped]
        doomed = [entry for entry in beyond_keep_last(committed, retention)
                  if entry.name != keep]
        if doomed or dropped:
            marked = {_identity(entry) for entry in doomed}
            gone = {_identity(entry) for entry in dropped}
            await self._update_ledger(root, lambda now: [
                dataclasses.replace(entry, pruning=True) if _identity(entry) in marked
                else entry for entry in now if _identity(entry) not in gone])
        for entry in [*unfinished, *doomed]:
            checkpoint = root.child(entry.name)
            await self._delete([checkpoint.child(name) for name in _COMMIT_POINTS])
            await self._remove_debris(checkpoint)
            logger.info("checkpoint %s: pruned (job %r keeps its %d newest)", checkpoint,
                        entry.job, retention.keep_last)
        if unfinished or doomed:
            done = {_identity(entry) for entry in [*unfinished, *doomed]}
            await self._update_ledger(root, lambda now: [
                entry for entry in now if _identity(entry) not in done])
        return [str(root.child(entry.name)) for entry in doomed]

    async def _manifest_token(self, checkpoint: ObjectUrl) -> str | None:
        manifest = checkpoint.child(MANIFEST_NAME)
        try:
            head = await self.client.call("head_object", manifest, Bucket=manifest.bucket,
                                          Key=manifest.key)
        except ObjectNotFoundError:
            return None
        return head.get("Metadata", {}).get(_SAVE_TOKEN)

    async def _sweep(self, root: ObjectUrl) -> None:
        """Delete what dead saves under `root` left (their claims name it), and abort uploads
        under the root older than `abandoned_after_s` that no live save claims."""
        listing = await list_folder(self.client, root)
        live: set[str] = set()
        for name in listing.sizes:
            checkpoint = claimed_checkpoint(name)
            if checkpoint is None:
                continue
            claim = root.child(name)
            if await self._claim_is_live(claim, listing):
                live.add(checkpoint)
                continue
            inside = (await list_folder(self.client, root.child(checkpoint))).sizes
            if not any(point in inside for point in _COMMIT_POINTS):
                logger.info("removing %s, left by a save that died", root.child(checkpoint))
                await self._remove_debris(root.child(checkpoint))
            await self._delete([claim])
        await self._abort_uploads(root, lambda key, age_s: (
            age_s > self.config.abandoned_after_s
            and key[len(root.prefix):].partition("/")[0] not in live), listing)

    async def _claim_is_live(self, claim: ObjectUrl, listing: Listing | None) -> bool:
        """Whether the save that wrote `claim` may still be running: ours, or its process
        alive on this host, or (another host's) younger than `abandoned_after_s`."""
        if str(claim) in _LIVE_CLAIMS:
            return True
        body = await self._read_small(claim)
        if body is None:
            return False  # gone meanwhile: its save committed or was discarded
        try:
            owner = json.loads(body)
            host, pid = owner["host"], owner["pid"]
        except (ValueError, KeyError, TypeError):
            host, pid = None, None
        if host == socket.gethostname() and isinstance(pid, int):
            return pid != os.getpid() and process_exists(pid)
        if listing is None:
            listing = await list_folder(self.client, claim.parent)
        return listing.age_s(claim.name) <= self.config.abandoned_after_s

    async def _remove_debris(self, checkpoint: ObjectUrl) -> None:
        """Abort every upload under `checkpoint` and delete every object in it."""
        await self._abort_uploads(checkpoint, lambda key, age_s: True, None)
        listing = await list_folder(self.client, checkpoint)
        await self._delete([checkpoint.child(name) for name in listing.sizes])

    async def _abort_uploads(self, folder: ObjectUrl, doomed: Callable[[str, float], bool],
                             listing: Listing | None) -> None:
        """Abort the uploads under `folder` whose key and age (seconds, by the store's clock
        in `listing`; infinite without one) are `doomed`."""
        bucket, prefix = folder.bucket, folder.prefix
        params = {"Bucket": bucket, "Prefix": prefix}
        aborts = []
        while True:
            page = await self.client.call("list_multipart_uploads", f"s3://{bucket}/{prefix}",
                                          **params)
            for upload in page.get("Uploads", ()):
                now = listing.now if listing is not None else None
                age_s = (now - upload["Initiated"]).total_seconds() if now else float("inf")
                if doomed(upload["Key"], age_s):
                    aborts.append((upload["Key"], upload["UploadId"]))
            if not page.get("IsTruncated"):
                break
            params.update(KeyMarker=page.get("NextKeyMarker", ""),
                          UploadIdMarker=page.get("NextUploadIdMarker", ""))
        for key, upload_id in aborts:
            with contextlib.suppress(ObjectNotFoundError):  # completed or aborted meanwhile
                await self.client.call("abort_multipart_upload", f"s3://{bucket}/{key}",
                                       Bucket=bucket, Key=key, UploadId=upload_id)

    # -- objects ------------------------------------------------------------------------------

    async def _put(self, url: ObjectUrl, body: bytes, **conditions: object) -> None:
        await self.client.call("put_object", url, Bucket=url.bucket, Key=url.key,
                               **self.client.body(body), **conditions)

    async def _read_small(self, url: ObjectUrl, max_bytes: int = 1 << 16) -> bytes | None:
        """The small object `url`, or None if there is none (or it is larger: not ours)."""
        try:
            data, _, _ = await self.client.get_small(url, max_bytes)
        except ObjectNotFoundError:
            return None
        return data

    async def _delete(self, urls: Iterable[ObjectUrl]) -> None:
        """Delete the objects `urls` (all in one bucket); a missing one is no error.

        Raises:
            StorageError: a delete failed (naming the object).
        """
        urls = list(urls)
        for start in range(0, len(urls), _DELETE_BATCH):
            batch = urls[start:start + _DELETE_BATCH]
            response = await self.client.call(
                "delete_objects", batch[0], Bucket=batch[0].bucket,
                Delete={"Objects": [{"Key": url.key} for url in batch], "Quiet": True})
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                key = errors[0].get("Key", "")
                raise StorageError(f"deleting s3://{batch[0].bucket}/{key}: "
                                   f"{errors[0].get('Code')}: {errors[0].get('Message')}",
                                   path=f"s3://{batch[0].bucket}/{key}", errno=None)

    async def _delete_quietly(self, urls: Iterable[ObjectUrl]) -> None:
        """`_delete`, a failure logged (what is left is debris the next commit removes)."""
        try:
            await self._delete(urls)
        except StorageError as error:
            logger.warning("%s (the next commit under its root retries)", error)

    # -- the file half: datasets ---------------------------------------------------------------
    # Objects are published whole by the store itself (a PUT or a completed upload), durably
    # once acknowledged: there is no directory to sync.

    def publish_file(self, path: str, write: Callable[[IO[bytes]], object], *,
                     sync_dir: bool = True) -> None:
        publish_with(self.client, path, write)

    def publish_buffers(self, path: str, buffers: Sequence[bytes | memoryview], *,
                        sync_dir: bool = True) -> None:
        publish_with(self.client, path, lambda f: [f.write(buffer) for buffer in buffers])

    def sync_dir(self, path: str) -> None:
        """Nothing to do: a stored object is durable."""

    def map_file(self, path: str) -> bytes:
        """The whole object, read into memory (a store maps nothing)."""
        return read_whole(self.client, path)

    def open_file(self, path: str) -> ObjectFile:
        return ObjectFile.open(self.client, path)

    def open_new_file(self, path: str) -> NewObject:
        return NewObject(self.client, path)

    def remove_file(self, path: str) -> None:
        remove(self.client, path)

    def __repr__(self) -> str:
        return f"<S3Backend {self.client.endpoint}>"


def _identity(entry: LedgerEntry) -> tuple[str, str, str]:
    """What names one commit in the ledger, whatever its pruning mark."""
    return entry.name, entry.engine, str(entry.manifest)


def _checkpoint_url(path: str) -> ObjectUrl:
    url = parse_url(path)
    if not url.key:
        raise ValueError(f"checkpoint {path!r}: expected s3://bucket/<name>, a checkpoint "
                         "under the bucket, found the bucket itself")
    return url
