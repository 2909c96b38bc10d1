"""The local (POSIX) filesystem backend: everything asynctron does with `os`, `fcntl` and
`mmap` on storage lives in this folder, the files a node-local cache shares among processes
(`_cache_files`) included."""

from asynctron.storage.backends.local._backend import LocalBackend, LocalCheckpoints
from asynctron.storage.backends.local._cache_files import (
    BlockFile,
    SharedCounters,
    SharedLock,
    file_size,
    holding,
    map_shared,
    publish_filled,
    read_head,
    replace_empty,
)

__all__ = ["BlockFile", "LocalBackend", "LocalCheckpoints", "SharedCounters", "SharedLock",
           "file_size", "holding", "map_shared", "publish_filled", "read_head", "replace_empty"]
