"""Storage: plan and split, per-bin writers, readers, the manifest and the commit protocol.

Never imports the engine; blocking calls run through the `RunBlocking` door
(`asynctron._concurrency`) that the engine passes in.
"""

from asynctron.storage._commit import resolve_checkpoint
from asynctron.storage._manifest import ItemRecord, Manifest
from asynctron.storage._reader import read_manifest
from asynctron.storage._split import split_by_size_and_type
from asynctron.storage._sysio import FileIO, LocalFileIO

__all__ = [
    "FileIO",
    "ItemRecord",
    "LocalFileIO",
    "Manifest",
    "read_manifest",
    "resolve_checkpoint",
    "split_by_size_and_type",
]
