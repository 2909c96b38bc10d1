"""`WriteBatch`: what a save hands a backend's `FileWriter`: file bytes ready to write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from asynctron.storage.format import BodySegments


class WriteBatch(Protocol):
    """File bytes [file_offset, +nbytes) ready to write. Its methods are called on the
    executor, once each."""

    @property
    def file_offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def buffers(self) -> Sequence[memoryview]:
        """iovecs covering all the batch's bytes, padding included."""
        ...

    def bodies(self) -> BodySegments:
        """Its items' bytes to digest, in file order."""
        ...
