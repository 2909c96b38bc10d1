"""Directory locks (`flock`) between the processes that save, prune and load in one root.

A lock belongs to its open file description: a process that dies, even by SIGKILL, drops
its own, so a directory nobody holds is one no live process is using.

Where the filesystem has no `flock` on directories (some NFS and Lustre mounts), a lock is
returned but not `held`: it excludes nothing, and callers decide what that proves.
"""

from __future__ import annotations

import errno
import fcntl
import os
from types import TracebackType

from asynctron.storage.node_files._sysio import translate_os_errors

_NO_FLOCK = frozenset({errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})


class DirLock:
    """A shared or exclusive `flock` on a directory, held until `release()`."""

    def __init__(self, fd: int, path: str, *, held: bool) -> None:
        self._fd = fd
        self.path = path
        self.held = held
        """False where the filesystem has no flock: the lock excludes nothing."""

    @classmethod
    def take(cls, path: str, *, exclusive: bool) -> DirLock:
        """Lock the directory `path` (never through a symlink), waiting for other holders.

        Raises:
            FileNotFoundError: `path` does not exist.
            StorageError: `path` is not a directory, or could not be opened or locked.
        """
        lock = cls._lock(path, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        assert lock is not None  # waited
        return lock

    @classmethod
    def try_take(cls, path: str, *, exclusive: bool) -> DirLock | None:
        """`take` without waiting: None if another holder conflicts."""
        return cls._lock(path, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)

    @classmethod
    def _lock(cls, path: str, operation: int) -> DirLock | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError:
            with translate_os_errors("opening directory", path):
                raise
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            return None
        except OSError as exc:
            if exc.errno in _NO_FLOCK:
                return cls(fd, path, held=False)
            os.close(fd)
            with translate_os_errors("locking directory", path):
                raise
        return cls(fd, path, held=True)

    def names(self, path: str) -> bool:
        """Whether `path` still names the locked directory (not removed, renamed or replaced)."""
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

