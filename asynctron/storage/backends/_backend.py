"""The storage seam: the operations checkpoints and datasets need of wherever their bytes live.

Everything above `storage` (the engine, the DCP plugins, datasets, the CLI) reaches bytes only
through a `Backend`. The seam is shaped by the commit protocol and the readers, not by a file
API: a save gets a private *area*, writes each file of known size into it, and `commit`
publishes the area as the checkpoint all at once (a rename on a filesystem; "manifest last" on
an object store); a load leases a committed checkpoint and reads ranges of its files into
given buffers. Datasets publish whole files and read (or map) them.

Checkpoint operations are coroutines awaited on the caller's loop, on the backend's
checkpoints bound to the caller's executor (`Backend.checkpoints(run_blocking)`, a cheap
binding an engine makes per save or load, the tiers once): a backend whose work blocks (the
local filesystem) runs it through that door, in as few calls as it can (a commit is one call);
one whose client is asyncio-native awaits its requests and uses the door only for CPU work
(hashing, encoding the manifest).
Dataset operations block: datasets call them from worker processes and from index builders,
never on a loop thread.

Adding a backend touches only its own module plus one `register_backend` call for its URL
scheme (`backends/__init__.py`).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Protocol, runtime_checkable

from asynctron._concurrency import RunBlocking

if TYPE_CHECKING:
    import mmap

    from asynctron.errors import CorruptCheckpointError
    from asynctron.storage.backends._write_batch import WriteBatch
    from asynctron.storage.format import Checksums, ItemHasher, ItemRecord, Manifest, ReadJob


@dataclass(frozen=True, slots=True)
class SaveArea:
    """Where a save's files go until it commits: private to that save, invisible to readers.

    Plain data, so the coordinator can send it to every rank; the backend that made it keeps
    whatever marks it live (a lock) until `commit` or `discard`.
    """

    final_path: str
    """The checkpoint the save publishes."""
    location: str
    """The area itself (a tmp dir beside `final_path` on a filesystem, a claim object on a
    store). Its name holds nothing of `final_path`'s: a scan that picks checkpoints by name
    (torchtitan's newest `step-<digits>` folder) never takes an area for a checkpoint."""


@dataclass(frozen=True, slots=True)
class Retention:
    """An engine's `keep_last`: keep the `keep_last` newest checkpoints of `job`, which
    `engine` (a token unique to the engine) commits with its save numbers."""

    job: str
    engine: str
    keep_last: int


@dataclass(frozen=True, slots=True)
class Committed:
    """What followed a commit: whether `latest` now names it, the checkpoints pruned, and the
    problems that did not undo it (`latest` not moved, pruning failed)."""

    moved_latest: bool = False
    pruned: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


class FileWriter(Protocol):
    """Writes one file of a save's area in order, batch by batch; owned by one task."""

    async def open(self) -> None:
        """Create the file. Even if cancelled, what was opened is closed by `aclose`."""
        ...

    @property
    def done(self) -> bool:
        """Whether the file is complete and durable."""
        ...

    async def write(self, batches: Sequence[WriteBatch],
                    on_written: Callable[[WriteBatch], None]) -> None:
        """Write `batches` (consecutive, continuing the file), digesting their items first;
        `on_written(batch)` after each, from the thread that wrote it. The call that
        completes the file makes it durable.

        Raises:
            StorageError: the write failed (naming the file).
        """
        ...

    async def aclose(self) -> None:
        """Release the file if still open (after a failure); never raises StorageError."""
        ...


class ItemReader(Protocol):
    """Reads the items of an open checkpoint into given buffers: what a load's data path
    calls. Several `read` calls may run at once."""

    path: str
    """The checkpoint read (after `open`: the one `latest` named, if it was followed)."""

    @property
    def verifiable(self) -> bool:
        """Whether the checkpoint carries checksums to verify."""
        ...

    def file_path(self, record: ItemRecord) -> str:
        """The full name of the file that holds `record` (for messages)."""
        ...

    async def read(self, jobs: Sequence[ReadJob], *, verify: bool, slab_bytes: int,
                   progress: Callable[[int], None] | None = None
                   ) -> list[CorruptCheckpointError]:
        """Read every job into its destination (or only hash it), in calls of at most
        `slab_bytes`; `progress(nbytes)` as bytes land.

        Returns:
            with `verify` (and checksums in the checkpoint), one error per item whose digest
            differs, naming file, key and offset; else an empty list.

        Raises:
            CorruptCheckpointError: a file ends early (names the file and item).
            StorageError: a read failed.
        """
        ...

    async def read_range(self, record: ItemRecord, start: int, destination: memoryview,
                         hasher: ItemHasher | None) -> None:
        """Read `record`'s bytes [start, +destination.nbytes) into `destination`, continuing
        `hasher` over them."""
        ...

    def digest_error(self, record: ItemRecord, found: str) -> CorruptCheckpointError | None:
        """The error for `record` if `found` is not its digest, else None."""
        ...



@runtime_checkable
class MappedItems(Protocol):
    """A capability of an `ItemReader` whose checkpoint lies in files this node can map (the
    local filesystem's): items read lazily, page by page, as a load with `mmap=True` wants."""

    async def map(self, record: ItemRecord) -> memoryview:
        """A copy-on-write map of the item's bytes, read when touched."""
        ...

    async def check_mapped(self, record: ItemRecord, view: memoryview) -> None:
        """Hash a mapped item and raise `CorruptCheckpointError` if it differs."""
        ...


class CheckpointLease(Protocol):
    """A committed checkpoint found and held for a load (what the load's planning calls):
    opened, its small files read, released."""

    requested_path: str
    manifest: Manifest | None

    async def open(self) -> Manifest:
        """Find the checkpoint (following `latest`), read and validate its manifest against
        its files (each present, with its recorded size).

        Raises:
            CheckpointNotFoundError: nothing committed at the path.
            CorruptCheckpointError: a bad manifest, or a file missing or of the wrong size.
        """
        ...

    def adopt(self, path: str, manifest: Manifest) -> None:
        """Read the checkpoint `path` (committed, `latest` already followed) by `manifest`, as
        another process's `open` found them: nothing is asked of the storage."""
        ...

    def path_of(self, name: str) -> str:
        """The full name of the checkpoint's file `name` (for messages)."""
        ...

    async def read_file(self, name: str, max_bytes: int) -> bytes:
        """The whole small file `name` of the checkpoint (DCP's `.metadata`).

        Raises:
            CorruptCheckpointError: larger than `max_bytes`, or not a plain file.
            StorageError: no such file, or the read failed.
        """
        ...

    async def aclose(self) -> None:
        """Release the reader and its lease (maps stay valid while tensors use them)."""
        ...


class CheckpointReader(CheckpointLease, ItemReader, Protocol):
    """One committed checkpoint, leased (`CommittedCheckpoints.open_reader`): found and
    validated as a `CheckpointLease`, its items read as an `ItemReader` (and mapped where it
    is `MappedItems`)."""


class SaveStorage(Protocol):
    """A save's side of a backend's checkpoints: a private area, its files, its commit (what
    the coordinator, the writers and the DCP writer call). Its I/O operations are coroutines,
    awaited on the caller's loop.

    Durability: a committed checkpoint survives a crash of the machine.
    Atomicity: `commit` makes a checkpoint visible whole or not at all; a crash or failure at
    any point leaves the previous checkpoints as they were.
    """

    def area_of(self, final_path: str, name: str | None = None) -> SaveArea:
        """The area of a save to `final_path`, named: every rank of a save that must find it
        without being told (DCP's) gets the same one for the same `name`. None names a fresh,
        unique one. Its location's name holds nothing of `final_path`'s (see `SaveArea`).
        Makes nothing (see `start_save`)."""
        ...

    async def start_save(self, area: SaveArea) -> None:
        """Refuse an existing checkpoint at `area.final_path`, then make `area` (replacing one
        of that name a dead save left), live until `commit` or `discard`.

        Raises:
            FileExistsError: the checkpoint exists, or a live save holds the area.
            StorageError: the area could not be made.
        """
        ...

    def open_writer(self, area: SaveArea, name: str, nbytes: int, *, direct_io: bool,
                    checksums: Checksums | None) -> FileWriter:
        """A writer of the file `name` (exactly `nbytes`) in `area`, written in order batch by
        batch; durable once its last batch is written. Any rank may open one in an area the
        coordinator made."""
        ...

    async def is_in_memory(self, area: SaveArea) -> bool:
        """Whether `area`'s bytes live only in memory (tmpfs): a write from the caller's
        memory is then as fast as any, so staging copies buy nothing."""
        ...

    async def commit(self, area: SaveArea,
                     files: Callable[[], Mapping[str, bytes]], *, retention: Retention | None,
                     seq: int, move_latest: bool) -> Committed:
        """Publish `area`, whose data files are all durable, as its checkpoint: `files()` (the
        manifest, made on the executor) written into it last, then the checkpoint made visible
        at once. Then, with `move_latest`, point `latest` at it; with `retention`, prune the
        job's checkpoints beyond `keep_last` (`seq`, the save's number in its engine, orders
        them); and remove what dead saves left. The area is no longer live afterwards,
        committed or not (the caller `discard`s a failed one).

        Raises:
            FileExistsError: the checkpoint appeared meanwhile; nothing is committed.
            StorageError: writing or publishing failed; nothing is committed.
        """
        ...

    async def discard(self, area: SaveArea) -> None:
        """Remove the area of a save that will not commit, and what it holds, if it is still
        the live area this backend made; never raises (a failure is logged: an area is never
        taken for a checkpoint, and the next commit beside it removes what is left)."""
        ...


class CommittedCheckpoints(Protocol):
    """A backend's committed checkpoints: opened for a load (leased), listed and removed
    (what loads, retention and the tiers call). Its I/O operations are coroutines, awaited on
    the caller's loop."""

    async def open_reader(self, path: str, *,
                          max_files_at_once: int) -> CheckpointReader:
        """A reader of the committed checkpoint at `path`, or of the one `path/latest` names,
        leased where the backend can: no pruning removes it until `reader.aclose()`.

        Raises:
            CheckpointNotFoundError: nothing committed there.
        """
        ...

    async def list_checkpoints(self, root: str) -> list[str]:
        """The names of the committed checkpoints directly under `root` (none if `root` does
        not exist), in one listing of the storage.

        Raises:
            StorageError: the listing failed.
        """
        ...

    async def remove_checkpoint(self, path: str) -> bool:
        """Delete the committed checkpoint at `path`: it stops being a checkpoint at once (a
        reader never finds it half there), then its files go. Returns whether it was removed:
        False when nothing is committed there, or (where the backend leases) a load holds it.

        Raises:
            StorageError: the removal failed (what is left is debris the next commit beside
                it removes, never a checkpoint).
        """
        ...


class CheckpointStorage(SaveStorage, CommittedCheckpoints, Protocol):
    """A backend's checkpoints, bound to the executor its blocking work runs on
    (`Backend.checkpoints`): a cheap binding, made per save or load by an engine and the DCP
    plugins, once by the tiers."""


class FileStorage(Protocol):
    """The dataset half of a `Backend`: whole files published atomically, read at offsets or
    mapped. Every call blocks (datasets make them from worker processes and index builders,
    never on a loop thread).

    Durability: a published file survives a crash of the machine (its directory synced).
    Atomicity: a published file's path names its old file or the whole new one, never a part.
    """

    def publish_file(self, path: str, write: Callable[[IO[bytes]], object], *,
                     sync_dir: bool = True) -> None:
        """Blocks: call `write(f)` on a new file and publish it as `path`: afterwards `path` is
        either its old file or the whole new one, durably (the directory synced too unless
        `sync_dir` is False: see `sync_dir`). On error `path` is untouched."""
        ...

    def publish_buffers(self, path: str, buffers: Sequence[bytes | memoryview], *,
                        sync_dir: bool = True) -> None:
        """Blocks: publish the bytes of `buffers`, one after another, as the file `path`, with
        the guarantees of `publish_file` (written past the page cache where the storage
        allows)."""
        ...

    def sync_dir(self, path: str) -> None:
        """Blocks: make the files published into the directory `path` with `sync_dir=False`
        durable at once."""
        ...

    def open_file(self, path: str) -> ReadableFile:
        """Blocks: open the existing file `path` for reads at given offsets (`pread`), until
        `close()`; its `nbytes` is its size when opened. For reads on a hot path (a
        dataset's samples with `mmap=False`): each is one call to the storage, nothing more.

        Raises:
            FileNotFoundError: no file at `path`.
            IsADirectoryError: `path` is a directory.
            OSError: the open failed (naming `path`).
        """
        ...

    def open_new_file(self, path: str) -> NewFile:
        """Blocks: start the file `path`, written piece by piece (`write`) over any length of
        time and published whole by `publish`, with the guarantees of `publish_file`; until
        then `path` is untouched, and `close()` without `publish` discards what was written.
        Like every publish, creates the missing directories of `path`.

        Raises:
            OSError: the file could not be started (naming `path`).
        """
        ...

    def remove_file(self, path: str) -> None:
        """Blocks: remove the file `path` (a published one: never a temporary); nothing there
        is not an error. Durable once the directory is synced (`sync_dir`).

        Raises:
            OSError: the removal failed (naming `path`).
        """
        ...


class ReadableFile(Protocol):
    """An open file of a backend, read at given offsets (`Backend.open_file`). Reads from
    several threads at once are safe."""

    nbytes: int
    """The file's size when it was opened."""

    def pread(self, nbytes: int, offset: int) -> bytes:
        """Blocks: up to `nbytes` bytes from `offset`; fewer only at the end of the file or
        beyond what the storage returns in one call (2 GiB - 4 KiB on Linux)."""
        ...

    def pread_into(self, buffer: memoryview, offset: int) -> int:
        """Blocks: fill `buffer` with the bytes from `offset`; returns how many were read
        (fewer only at the end of the file)."""
        ...

    def close(self) -> None:
        """Release the file; closing again does nothing."""
        ...

    def __enter__(self) -> ReadableFile: ...

    def __exit__(self, *exc_info: object) -> None: ...


class RangedFile(ReadableFile, Protocol):
    """A `ReadableFile` of an object store (`RangedFiles.open_ranged_file`): a version of an
    object, and many ranges of it fetched at once."""

    etag: str
    """The version read: every read is of it (a replaced object fails the read)."""

    def fetch(self, ranges: Sequence[tuple[int, memoryview]]
              ) -> concurrent.futures.Future[None]:
        """Start filling each buffer with the bytes from its offset, all at once; returns at
        once. The future settles when every buffer is full, or with the first error."""
        ...


@runtime_checkable
class MappableFiles(Protocol):
    """A capability of a `FileStorage` whose files lie on this node: mapped where they lie
    (datasets' `mmap=True`, the index cache)."""

    def map_file(self, path: str) -> mmap.mmap | bytes:
        """Blocks: the whole file `path`, read-only, mapped (empty files as `b""`).

        Raises:
            OSError: the file could not be mapped (naming `path`).
        """
        ...


@runtime_checkable
class RangedFiles(Protocol):
    """A capability of a `FileStorage` whose files are read over a network in ranged requests
    (an object store): datasets keep what they read in a node-local cache, and loads share
    their reads among ranks."""

    def open_ranged_file(self, path: str) -> RangedFile:
        """Blocks: open the object `path` (one version of it) for many ranged reads at once;
        raises as `FileStorage.open_file`."""
        ...


def whole_file(storage: FileStorage, path: str) -> mmap.mmap | bytes:
    """Blocks: the whole file `path`, read-only: mapped where `storage` maps files
    (`MappableFiles`), else read into memory."""
    if isinstance(storage, MappableFiles):
        return storage.map_file(path)
    with storage.open_file(path) as file:
        buffer = bytearray(file.nbytes)
        view = memoryview(buffer)
        done = 0
        while done < file.nbytes:
            read = file.pread_into(view[done:], done)
            if read == 0:
                raise OSError(f"{path}: ended at byte {done} of {file.nbytes} while read whole")
            done += read
        return bytes(buffer)


class NewFile(Protocol):
    """A file being written, invisible until published (`Backend.open_new_file`). One thread
    at a time."""

    def write(self, data: bytes | memoryview) -> int:
        """Blocks: append all of `data`; returns its size in bytes.

        Raises:
            OSError: the write failed (naming the file); `close()` discards what was written.
        """
        ...

    def publish(self, *, sync_dir: bool = True) -> None:
        """Blocks: publish what was written as the file, as `Backend.publish_file` does (the
        directory synced unless `sync_dir` is False); on error the path is untouched and what
        was written is discarded. Either way the file is closed afterwards."""
        ...

    def close(self) -> None:
        """Blocks: discard what was written unless published; closing again does nothing."""
        ...

    def __enter__(self) -> NewFile: ...

    def __exit__(self, *exc_info: object) -> None: ...


@runtime_checkable
class Backend(FileStorage, Protocol):
    """Where a checkpoint's and a dataset's bytes live, one object per storage (`backend_for`
    picks it by URL scheme), in parts because their callers differ: datasets call the file
    operations (`FileStorage`) from worker processes; an engine binds the checkpoints to its
    executor (`checkpoints`, per save or load) and awaits them on its loop."""

    def locate(self, path: str | os.PathLike[str]) -> str:
        """The canonical name of `path` on this backend (a local path made absolute; a URL as
        it is); every checkpoint operation takes names made by this one."""
        ...

    def checkpoints(self, run_blocking: RunBlocking) -> CheckpointStorage:
        """The checkpoints of this storage, their blocking work (file I/O, hashing, encoding
        manifests) run through `run_blocking`. Every binding shares the backend's state (the
        saves it holds live), so a save started through one commits through another."""
        ...
