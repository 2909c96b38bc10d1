"""`WriteReport`: what one rank tells the coordinator once its files are written."""

from __future__ import annotations

from dataclasses import dataclass, field

from asynctron.storage import ItemRecord


@dataclass(frozen=True, slots=True)
class WriteReport:
    """One rank's result: its files, its items and their checksums, and its state dict's
    structure; or, when it failed, what went wrong."""

    rank: int
    records: tuple[ItemRecord, ...] = ()
    """The items' records (their checksums in `checksums`)."""
    checksums: tuple[str, ...] | None = None
    """Per record, its digest; None when saved without checksums."""
    files: dict[str, int] = field(default_factory=dict)
    structure: str | None = None
    """The structure, as JSON text."""
    error: str | None = None
    frames: tuple[tuple[int, int] | None, ...] = ()
    """Per record, in DCP's format, the lengths of the `torch.save` frame around its bytes."""
