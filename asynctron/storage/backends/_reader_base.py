"""What every backend's checkpoint reader shares (`CheckpointReaderBase`): the opened manifest
and the checks of item bytes against it; the I/O is the backend's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from asynctron._concurrency import RunBlocking, first_error
from asynctron.errors import CorruptCheckpointError
from asynctron.storage.format import ItemHasher, ItemRecord, Manifest, ReadJob, check_digest


class CheckpointReaderBase:
    """What every backend's checkpoint reader shares: the opened manifest and the checks of
    item bytes against it (the I/O is the backend's)."""

    def __init__(self, path: str, run_blocking: RunBlocking) -> None:
        self._run_blocking = run_blocking
        self.requested_path = path
        self.path = path
        """The checkpoint read (after `open`: the one `latest` named, if it was followed)."""
        self.manifest: Manifest | None = None

    def adopt(self, path: str, manifest: Manifest) -> None:
        """Read the checkpoint `path` by `manifest`, found by another process's `open`."""
        self.path, self.manifest = path, manifest

    @property
    def verifiable(self) -> bool:
        """Whether the checkpoint carries checksums to verify."""
        assert self.manifest is not None, "open() first"
        return self.manifest.checksum is not None

    def path_of(self, name: str) -> str:
        """The full name of the checkpoint's file `name` (for messages)."""
        return f"{self.path.rstrip('/')}/{name}"

    def file_path(self, record: ItemRecord) -> str:
        return self.path_of(record.file)

    def digest_error(self, record: ItemRecord, found: str) -> CorruptCheckpointError | None:
        """The error for `record` if `found` is not its digest, else None."""
        assert record.checksum is not None
        try:
            check_digest(key=record.key, path=self.file_path(record), offset=record.offset,
                         expected=record.checksum, found=found)
        except CorruptCheckpointError as error:
            return error
        return None

    async def read(self, jobs: Sequence[ReadJob], *, verify: bool, slab_bytes: int,
                   progress: Callable[[int], None] | None = None
                   ) -> list[CorruptCheckpointError]:
        """Read every job (one task per file, `read_file` for each, its jobs in file order).

        Returns:
            with `verify` (and a checkpoint that has checksums), one error per item whose
            digest differs, naming file, key and offset; else an empty list. Jobs whose
            record has no checksum (part of an item, read when resharding) are not checked.

        Raises:
            CorruptCheckpointError: a file ends early (names the file and item).
            StorageError: a read failed.
        """
        check = verify and self.verifiable
        by_file: dict[str, list[int]] = {}
        for index, job in enumerate(jobs):
            by_file.setdefault(job.record.file, []).append(index)
        found: dict[int, str] = {}

        async def read_file(name: str, indices: list[int]) -> None:
            indices.sort(key=lambda i: jobs[i].record.offset)
            file_jobs = [jobs[i] for i in indices]
            hashers = [ItemHasher() for _ in file_jobs] if check else None
            await self.read_file_jobs(name, file_jobs, hashers, slab_bytes=slab_bytes,
                                      progress=progress)
            if hashers is not None:
                for i, hasher in zip(indices, hashers, strict=True):
                    found[i] = hasher.hexdigest()

        try:
            async with asyncio.TaskGroup() as group:
                for name, indices in by_file.items():
                    group.create_task(read_file(name, indices))
        except BaseExceptionGroup as error:
            raise first_error(error)  # noqa: B904 (the group stays as __context__)
        return [error for i in sorted(found) if jobs[i].record.checksum is not None
                and (error := self.digest_error(jobs[i].record, found[i])) is not None]

    async def read_file_jobs(self, name: str, jobs: Sequence[ReadJob],
                             hashers: Sequence[ItemHasher] | None, *, slab_bytes: int,
                             progress: Callable[[int], None] | None) -> None:
        """Read `jobs`, all of the file `name` and sorted by offset, in batches of at most
        `slab_bytes` (`plan_reads`), continuing `hashers[i]` over job i's bytes in file
        order; `progress(nbytes)` as bytes land. The backend's I/O."""
        raise NotImplementedError
