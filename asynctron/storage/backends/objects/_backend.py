"""`ObjectStoreBackend`: checkpoints and dataset files on an object store, asyncio-native,
through one `ObjectClient` (S3, Azure Blob, GCS); its `ObjectCheckpoints` are the commit
protocol, written once for every cloud.

The commit protocol on a store (layout in `_layout`):
1. `start_save` refuses a committed checkpoint, then writes the save's *claim* beside it (a
   conditional PUT); a second live claim for the same checkpoint makes the later save back off.
2. Each rank's writers upload their data objects at their final keys (`ObjectWriter`). No
   manifest yet: no checkpoint.
3. `commit`: the ledger entry (with `keep_last`), then `manifest.json` (and DCP's `.metadata`)
   written only if absent (the store's own conditional write): the commit point, exactly
   once. Then `latest`, pruning (a pruned checkpoint loses its manifest first, so it is never
   half there), the debris of dead saves, and the claim.
A save that fails is `discard`ed: its uploads aborted, its objects deleted, its claim removed.
A save that dies leaves its claim; the next commit under the root finds it dead (its process
gone, on this host; older than the config's `abandoned_after_s`, elsewhere) and deletes what it
names. Retention deletes only what the ledger says its job committed, as locally.
"""

from __future__ import annotations

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
from asynctron.errors import ObjectNotFoundError, StorageError
from asynctron.storage.backends._backend import Committed, Retention, SaveArea
from asynctron.storage.backends._ledger import (
    LEDGER_NAME,
    MAX_LEDGER_BYTES,
    LedgerEntry,
    beyond_keep_last,
    encode_ledger,
    parse_ledger,
)
from asynctron.storage.backends.objects._client import ObjectClient, PreconditionFailedError
from asynctron.storage.backends.objects._files import (
    NewObject,
    ObjectFile,
    publish_with,
    remove,
)
from asynctron.storage.backends.objects._layout import (
    LATEST_NAME,
    Listing,
    ObjectUrl,
    claim_name,
    claimed_checkpoint,
    is_checkpoint_name,
    is_claim_name,
    is_claim_to,
    parse_url,
)
from asynctron.storage.backends.objects._reader import ObjectReader
from asynctron.storage.backends.objects._writer import ObjectWriter
from asynctron.storage.format import MANIFEST_NAME, METADATA_NAME, Checksums

logger = logging.getLogger(__name__)

_COMMIT_POINTS = (MANIFEST_NAME, METADATA_NAME)
"""A checkpoint is committed once one of these exists in it."""
_SAVE_TOKEN = "asynctron-save"
"""The user metadata on a manifest naming the save that wrote it (the ledger's identity)."""
_LEDGER_ATTEMPTS = 8
_LIVE_CLAIMS: dict[str, str] = {}
"""The claims of this process's saves in progress, by URL (every backend object's): the name
of the checkpoint each is for."""


class ObjectStoreBackend:
    """Checkpoints and the files of datasets on one object store, through `client`.

    Concurrency: one backend serves any number of saves and loads at once, on any loops,
    through any number of bindings (`checkpoints`).
    """

    def __init__(self, client: ObjectClient) -> None:
        self.client = client
        self.config = client.config

    def locate(self, path: str | os.PathLike[str]) -> str:
        return str(parse_url(os.fspath(path), self.client.schemes))

    def checkpoints(self, run_blocking: RunBlocking) -> ObjectCheckpoints:
        return ObjectCheckpoints(self.client, run_blocking)

    # -- the files of datasets -----------------------------------------------------------------
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

    def open_file(self, path: str) -> ObjectFile:
        return ObjectFile.open(self.client, path)

    def open_ranged_file(self, path: str) -> ObjectFile:
        return ObjectFile.open(self.client, path)

    def open_new_file(self, path: str) -> NewObject:
        return NewObject(self.client, path)

    def remove_file(self, path: str) -> None:
        remove(self.client, path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.client.endpoint}>"


class ObjectCheckpoints:
    """The checkpoints of the store `client` serves: the commit protocol above; CPU work
    (hashing, encoding the manifest) through `run_blocking`, requests awaited natively."""

    def __init__(self, client: ObjectClient, run_blocking: RunBlocking) -> None:
        self.client = client
        self.config = client.config
        self._run_blocking = run_blocking

    def _url(self, path: str) -> ObjectUrl:
        return parse_url(path, self.client.schemes)

    def _checkpoint_url(self, path: str) -> ObjectUrl:
        url = self._url(path)
        if not url.key:
            raise ValueError(f"checkpoint {path!r}: expected {url.scheme}://bucket/<name>, a "
                             "checkpoint under the bucket, found the bucket itself")
        return url

    def area_of(self, final_path: str, name: str | None = None) -> SaveArea:
        url = self._checkpoint_url(final_path)
        return SaveArea(final_path, str(url.parent.child(claim_name(url.name, name))))

    async def start_save(self, area: SaveArea) -> None:
        url = self._checkpoint_url(area.final_path)
        claim = self._url(area.location)
        found = await self.client.list(url)
        if any(name in found.sizes for name in _COMMIT_POINTS):
            raise FileExistsError(
                f"checkpoint {url}: expected a new path, found a committed checkpoint; save to "
                "a new path (e.g. one per step) or remove it first")
        body = json.dumps({"checkpoint": url.name, "host": socket.gethostname(),
                           "pid": os.getpid()}).encode()
        try:
            await self.client.put(claim, body, if_none_match=True)
        except PreconditionFailedError:  # a named area (DCP's): a save before us left it
            if await self._claim_is_live(claim, None):
                raise FileExistsError(
                    f"checkpoint {url}: another save to this path is in progress (it holds "
                    f"{claim}); save to a new path") from None
            await self.client.put(claim, body)
        _LIVE_CLAIMS[str(claim)] = url.name
        try:
            await self._settle_rivals(url, claim, found)
        except BaseException:
            _LIVE_CLAIMS.pop(str(claim), None)
            await self._delete_quietly([claim])
            raise

    async def _settle_rivals(self, url: ObjectUrl, claim: ObjectUrl, found: Listing) -> None:
        """Back off if another live save claims `url`; delete what dead saves to it left."""
        root = await self.client.list(url.parent)
        rivals = [url.parent.child(name) for name in root.sizes
                  if name != claim.name and is_claim_to(name, url.name)]
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

    def open_writer(self, area: SaveArea, name: str, nbytes: int, *, direct_io: bool,
                    checksums: Checksums | None) -> ObjectWriter:
        return ObjectWriter(self.client, self._checkpoint_url(area.final_path).child(name), nbytes,
                            self._run_blocking, checksums=checksums)

    async def is_in_memory(self, area: SaveArea) -> bool:
        return False

    async def commit(self, area: SaveArea,
                     files: Callable[[], Mapping[str, bytes]], *, retention: Retention | None,
                     seq: int, move_latest: bool) -> Committed:
        url = self._checkpoint_url(area.final_path)
        root = url.parent
        contents = await self._run_blocking(files)
        token = secrets.token_hex(16)
        if retention is not None:
            entry = LedgerEntry(retention.job, url.name, retention.engine, seq, token)
            await self._update_ledger(root, lambda entries: [*entries, entry])
        points = [name for name in contents if name in _COMMIT_POINTS]
        for name in [name for name in contents if name not in _COMMIT_POINTS] + points:
            try:
                await self.client.put(url.child(name), contents[name], if_none_match=True,
                                      metadata={_SAVE_TOKEN: token})
            except PreconditionFailedError:
                raise FileExistsError(f"checkpoint {url}: another save committed it meanwhile; "
                                      "nothing of this save is committed") from None
        warnings: list[str] = []
        moved = False
        if move_latest:
            try:
                await self.client.put(root.child(LATEST_NAME), url.name.encode())
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
        _LIVE_CLAIMS.pop(area.location, None)
        await self._delete_quietly([self._url(area.location)])
        return Committed(moved, tuple(pruned), tuple(warnings))

    async def discard(self, area: SaveArea) -> None:
        if area.location not in _LIVE_CLAIMS:
            return
        url = self._checkpoint_url(area.final_path)
        try:
            found = await self.client.list(url)
            if not any(name in found.sizes for name in _COMMIT_POINTS):
                await self._remove_debris(url)
        except StorageError as error:
            logger.warning("could not remove the objects of a save that did not commit (the "
                           "next commit under %s does): %s", url.parent, error)
        _LIVE_CLAIMS.pop(area.location, None)
        await self._delete_quietly([self._url(area.location)])

    async def open_reader(self, path: str, *,
                          max_files_at_once: int) -> ObjectReader:
        return ObjectReader(self.client, path, self._run_blocking,
                            max_files_at_once=max_files_at_once)

    async def list_checkpoints(self, root: str) -> list[str]:
        """One listing of every object under `root` (paged), kept to the checkpoints whose
        commit point is there."""
        listing = await self.client.list(self._url(root), recursive=True)
        return sorted({name for name, _, rest in (key.partition("/") for key in listing.sizes)
                       if rest in _COMMIT_POINTS and is_checkpoint_name(name)})

    async def remove_checkpoint(self, path: str) -> bool:
        """Its commit points first (it stops being a checkpoint), then every object in it.
        No lease on a store: a load reading it fails clearly (a missing object)."""
        checkpoint = self._checkpoint_url(path)
        found = await self.client.list(checkpoint)
        if not any(name in found.sizes for name in _COMMIT_POINTS):
            return False
        await self.client.delete([checkpoint.child(name) for name in _COMMIT_POINTS])
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
            try:
                await self.client.put(ledger, encode_ledger(change(entries)),
                                      if_match=etag or None, if_none_match=not etag)
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
            await self.client.delete([checkpoint.child(name) for name in _COMMIT_POINTS])
            await self._remove_debris(checkpoint)
            logger.info("checkpoint %s: pruned (job %r keeps its %d newest)", checkpoint,
                        entry.job, retention.keep_last)
        if unfinished or doomed:
            done = {_identity(entry) for entry in [*unfinished, *doomed]}
            await self._update_ledger(root, lambda now: [
                entry for entry in now if _identity(entry) not in done])
        return [str(root.child(entry.name)) for entry in doomed]

    async def _manifest_token(self, checkpoint: ObjectUrl) -> str | None:
        try:
            head = await self.client.head(checkpoint.child(MANIFEST_NAME))
        except ObjectNotFoundError:
            return None
        return head.metadata.get(_SAVE_TOKEN)

    async def _sweep(self, root: ObjectUrl) -> None:
        """Delete what dead saves under `root` left (their claims' bodies name it), and abort
        uploads under the root older than `abandoned_after_s` that no live save claims."""
        listing = await self.client.list(root)
        live: set[str] = set()
        for name in listing.sizes:
            if not is_claim_name(name):
                continue
            claim = root.child(name)
            ours = _LIVE_CLAIMS.get(str(claim))
            if ours is not None:
                live.add(ours)
                continue
            owner = await self._read_claim(claim)
            if owner is None:
                continue  # gone meanwhile: its save committed or was discarded
            checkpoint = claimed_checkpoint(name, owner)
            if checkpoint is None:
                continue  # not a claim asynctron wrote: nothing is known to be its debris
            if await self._claim_is_live(claim, listing, owner):
                live.add(checkpoint)
                continue
            inside = (await self.client.list(root.child(checkpoint))).sizes
            if not any(point in inside for point in _COMMIT_POINTS):
                logger.info("removing %s, left by a save that died", root.child(checkpoint))
                await self._remove_debris(root.child(checkpoint))
            await self.client.delete([claim])
        await self._abort_uploads(root, lambda key, age_s: (
            age_s > self.config.abandoned_after_s
            and key[len(root.prefix):].partition("/")[0] not in live), listing)

    async def _claim_is_live(self, claim: ObjectUrl, listing: Listing | None,
                             owner: Mapping[str, object] | None = None) -> bool:
        """Whether the save that wrote `claim` (whose body is `owner`, if already read) may
        still be running: ours, or its process alive on this host, or (another host's) younger
        than `abandoned_after_s`."""
        if str(claim) in _LIVE_CLAIMS:
            return True
        if owner is None:
            owner = await self._read_claim(claim)
        if owner is None:
            return False  # gone meanwhile: its save committed or was discarded
        host, pid = owner.get("host"), owner.get("pid")
        if host == socket.gethostname() and isinstance(pid, int):
            return pid != os.getpid() and process_exists(pid)
        if listing is None:
            listing = await self.client.list(claim.parent)
        return listing.age_s(claim.name) <= self.config.abandoned_after_s

    async def _read_claim(self, claim: ObjectUrl) -> dict[str, object] | None:
        """The body of `claim` (its save's checkpoint, host and process; empty if it is not
        such a record), or None if there is no such object."""
        body = await self._read_small(claim)
        if body is None:
            return None
        try:
            owner = json.loads(body)
        except ValueError:
            return {}
        return owner if isinstance(owner, dict) else {}

    async def _remove_debris(self, checkpoint: ObjectUrl) -> None:
        """Abort every upload under `checkpoint` and delete every object in it."""
        await self._abort_uploads(checkpoint, lambda key, age_s: True, None)
        listing = await self.client.list(checkpoint)
        await self.client.delete([checkpoint.child(name) for name in listing.sizes])

    async def _abort_uploads(self, folder: ObjectUrl, doomed: Callable[[str, float], bool],
                             listing: Listing | None) -> None:
        """Abort the uploads under `folder` whose key and age (seconds, by the store's clock
        in `listing`; infinite without one) are `doomed`."""
        now = listing.now if listing is not None else None
        for upload in await self.client.list_uploads(folder):
            started = upload.started
            age_s = (now - started).total_seconds() if now and started else float("inf")
            if doomed(upload.key, age_s):
                await self.client.abort_upload(ObjectUrl(folder.scheme, folder.bucket,
                                                         upload.key), upload.upload_id)

    # -- objects ------------------------------------------------------------------------------

    async def _read_small(self, url: ObjectUrl, max_bytes: int = 1 << 16) -> bytes | None:
        """The small object `url`, or None if there is none (or it is larger: not ours)."""
        try:
            data, _, _ = await self.client.get_small(url, max_bytes)
        except ObjectNotFoundError:
            return None
        return data

    async def _delete_quietly(self, urls: Iterable[ObjectUrl]) -> None:
        """Delete `urls`, a failure logged (what is left is debris the next commit removes)."""
        try:
            await self.client.delete(list(urls))
        except StorageError as error:
            logger.warning("%s (the next commit under its root retries)", error)


def _identity(entry: LedgerEntry) -> tuple[str, str, str]:
    """What names one commit in the ledger, whatever its pruning mark."""
    return entry.name, entry.engine, str(entry.manifest)

