"""Every exception asynctron raises on purpose; the type says who must act.

- `ClosedError`: you closed the engine; open a new one.
- `StorageError`: the storage failed (ENOSPC, EIO, ...); `__cause__` is the `OSError`.
- `ObjectNotFoundError`: an object store holds no such object or bucket (a `StorageError`, and
  a `FileNotFoundError` as a missing local file is).
- `RefusedCredentialsError`: an object store refused our credentials (a `StorageError`; the
  message says what sets them).
- `BusyError`: two tasks used a one-at-a-time resource (e.g. two saves to one path).
- `CorruptCheckpointError`: the bytes on disk are not what was committed. Never retried.
- `CorruptDatasetError`: a dataset file (`.idx`, `.bin`, cached `.npy` index) is not in the
  format it claims (magic, version, dtype code, sizes). Never retried.
- `LoaderWorkerError`: a data loader's worker process died, or an error it raised on a batch
  could not reach the consumer as itself (an error that can does, as its own type).
- `PeerError`: another rank failed or timed out (a collective could not complete);
  `PeerTimeoutError` when it timed out.
- `CheckpointNotFoundError`: no committed checkpoint at the path (also a `FileNotFoundError`).
- `WouldBlock`: raised only by `*_nowait` calls that would have to wait.

Every timeout raises the builtin `TimeoutError` (which `asyncio.TimeoutError` and
`concurrent.futures.TimeoutError` are on Python 3.11+): `SaveTask.result(timeout)`,
`BackgroundEngine.run(..., timeout=)`, and across ranks `PeerTimeoutError` (a `PeerError` that
is also a `TimeoutError`), so `except TimeoutError` catches them all.

Bad arguments raise `ValueError` / `TypeError` at call time, before any work starts;
`BlendSizeError` is the `ValueError` of a blend without a size (also the `AssertionError`
megatron-core raises there).

Every error here is also exported by `asynctron` itself.
"""

from __future__ import annotations

__all__ = [
    "AsynctronError",
    "BlendSizeError",
    "BusyError",
    "CheckpointNotFoundError",
    "ClosedError",
    "CorruptCheckpointError",
    "CorruptDatasetError",
    "LoaderWorkerError",
    "ObjectNotFoundError",
    "PeerError",
    "PeerTimeoutError",
    "RefusedCredentialsError",
    "RefusedObjectError",
    "StorageError",
    "WouldBlock",
]


class AsynctronError(Exception):
    """Root of every asynctron error.

    Picklable with its attributes (those given as keywords too), so an error crosses process
    boundaries intact (DCP gathers every rank's failure at the coordinator by pickling it).
    """

    def __reduce__(self) -> tuple[object, ...]:
        return _rebuild_error, (type(self), self.args, dict(self.__dict__))


def _rebuild_error(cls: type[AsynctronError], args: tuple[object, ...],
                   state: dict[str, object]) -> AsynctronError:
    """An unpickled asynctron error: its args and attributes, without calling `__init__`
    (whose keyword-only arguments pickle's default would leave out)."""
    error = cls.__new__(cls, *args)
    error.args = args  # OSError's `__new__` leaves them to `__init__` in subclasses
    error.__dict__.update(state)
    return error


class ClosedError(AsynctronError):
    """The engine (or another resource) was closed by its owner."""


class StorageError(AsynctronError):
    """The storage failed underneath us; the original `OSError` is `__cause__`.

    Attributes:
        path: the file or directory the failing operation touched.
        errno: the OS error number (e.g. `errno.ENOSPC`), or None.
    """

    def __init__(self, message: str, *, path: str, errno: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """An object store holds no such object (or bucket). Also a `FileNotFoundError`, as a
    missing local file is, so `except FileNotFoundError` does the same on every backend; the
    message names the endpoint, bucket and key."""

    def __init__(self, message: str, *, path: str, errno: int | None = None) -> None:
        super().__init__(message, path=path, errno=errno)
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])


class RefusedCredentialsError(StorageError):
    """An object store refused the request's credentials (or its signature): retrying will
    not help until they change; the message names the endpoint and what sets them."""


class BusyError(AsynctronError):
    """Two tasks used a resource that admits one at a time."""


class CorruptCheckpointError(AsynctronError):
    """Checkpoint bytes differ from what was committed (checksum, magic, truncation, bad manifest).

    Attributes:
        path: the file at fault.
        key: the item at fault, or None when the fault is in the file as a whole.
        offset: the byte offset in `path` where the fault is, or None.
    """

    def __init__(
        self, message: str, *, path: str, key: str | None = None, offset: int | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.key = key
        self.offset = offset


class RefusedObjectError(CorruptCheckpointError, TypeError):
    """An item's pickled value holds globals (classes, functions) asynctron does not unpickle;
    the bytes are intact. A `TypeError`; also a `CorruptCheckpointError`, so that whatever
    reports unloadable items (`asynctron verify`) reports it too.

    Attributes: those of `CorruptCheckpointError`, and `refused`: what was refused (the
    globals' `module.name`s).
    """

    def __init__(self, refused: str, message: str, *, path: str, key: str | None = None
                 ) -> None:
        super().__init__(message, path=path, key=key)
        self.refused = refused


class CorruptDatasetError(AsynctronError):
    """A dataset file is not in its format: wrong magic or version, unknown dtype code, a size
    that does not match its header, a cached index of the wrong shape or dtype.

    Attributes:
        path: the file at fault.
        offset: the byte offset in `path` where the fault is, or None.
    """

    def __init__(self, message: str, *, path: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


class LoaderWorkerError(AsynctronError):
    """A data loader's worker process died (killed, out of memory), or raised an error on a
    batch that cannot reach the consumer as itself (it does not pickle within a worker's
    report, or unpickle in the loader's process): the message names its type, message and
    why, and `__cause__` holds the worker's traceback text. An error that can reach the
    consumer is raised as itself, not as this.

    Attributes:
        worker: the worker's index.
        batch: the batch (counted from where the loader started) it was writing, or None.
    """

    def __init__(self, message: str, *, worker: int, batch: int | None) -> None:
        super().__init__(message)
        self.worker = worker
        self.batch = batch


class PeerError(AsynctronError):
    """Another rank failed or timed out; `rank` says which, or is None when the backend's
    error does not tell (the message then names the group's ranks)."""

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


class PeerTimeoutError(PeerError, TimeoutError):
    """Another rank did not answer within a timeout (a collective's `timeout_s`, the process
    group's, or `coordination_timeout_s`): a `PeerError`, and a `TimeoutError` like every
    timeout asynctron raises."""

    def __str__(self) -> str:
        return str(self.args[0])


class CheckpointNotFoundError(AsynctronError, FileNotFoundError):
    """No committed checkpoint at the given path."""

    def __init__(self, message: str, *, path: str) -> None:
        AsynctronError.__init__(self, message)
        self.path = path
        self.filename = path

    def __str__(self) -> str:
        return str(self.args[0])


class WouldBlock(AsynctronError):
    """A `*_nowait` call would have had to wait."""


class BlendSizeError(ValueError, AssertionError):
    """A split has blend weights but no size. Also an AssertionError, which is what
    megatron-core raises here and what code written for it catches."""
