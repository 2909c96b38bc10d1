"""Files on this node: everything asynctron does with `os`, `fcntl` and `mmap`, in one home
that the local backend and the datasets' node-local cache both build on.

    LocalFiles()                 # whole files published atomically and durably, read, mapped
    DirLock.take(path, ...)      # a directory's flock (a save's area, a load's lease)
    SharedLock / SharedCounters  # a lock and counters shared by the processes of one node
    BlockFile / publish_filled   # a sparse file of blocks; a file filled through a map

Every call blocks; failures raise `OSError` (or `StorageError`) naming the file.
"""

from asynctron.storage.node_files._cache_files import (
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
from asynctron.storage.node_files._files import LocalFiles
from asynctron.storage.node_files._locks import DirLock
from asynctron.storage.node_files._sysio import FileIO, LocalFileIO

__all__ = ["BlockFile", "DirLock", "FileIO", "LocalFileIO", "LocalFiles", "SharedCounters",
           "SharedLock", "file_size", "holding", "map_shared", "publish_filled", "read_head",
           "replace_empty"]
