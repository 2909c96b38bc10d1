"""The retention ledger every backend keeps beside its checkpoints: which job committed which
checkpoint, in what order, so `keep_last` prunes only what its job wrote.

One JSON line per committed checkpoint: its job, its name, the engine that committed it and
that engine's save number, and the identity of its manifest when committed (a file's (inode,
mtime) locally, an object's ETag on a store). Order: engines by their first entry (a restart
comes after the run it resumed), one engine's saves by number; no clock is read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from asynctron.storage.backends._backend import Retention

logger = logging.getLogger(__name__)

LEDGER_NAME = ".asynctron-ledger"
#: A ledger larger than this is ignored (it holds a line per live checkpoint: ~150 bytes).
MAX_LEDGER_BYTES = 16 << 20

ManifestIdentity = tuple[int, int] | str


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One committed checkpoint of a job, as the ledger records it."""

    job: str
    name: str
    engine: str
    seq: int
    manifest: ManifestIdentity
    """Its manifest when committed: (inode, mtime in ns) of a file, or a save's token."""
    pruning: bool = False
    """Being deleted: a backend that cannot delete a checkpoint at once (an object store)
    marks it first, so a pruner that dies midway leaves the rest to the next one."""

    def to_json(self) -> str:
        manifest = self.manifest if isinstance(self.manifest, str) else list(self.manifest)
        fields = {"job": self.job, "name": self.name, "engine": self.engine, "seq": self.seq,
                  "manifest": manifest}
        if self.pruning:
            fields["pruning"] = True
        return json.dumps(fields, separators=(",", ":"))


def parse_ledger(data: bytes, where: str, is_checkpoint_name: Callable[[str], bool]
                 ) -> list[LedgerEntry]:
    """The entries of ledger bytes `data`, in order. Lines that are not entries are skipped,
    with a warning naming `where` (their checkpoints are then never pruned)."""
    entries = []
    for number, line in enumerate(data.splitlines(), 1):
        entry = _parse_entry(line, is_checkpoint_name)
        if entry is None:
            logger.warning("ledger %s line %d: expected a checkpoint entry, found %r; "
                           "ignored (that checkpoint is never pruned)", where, number, line[:80])
        else:
            entries.append(entry)
    return entries


def encode_ledger(entries: Iterable[LedgerEntry]) -> bytes:
    return "".join(f"{entry.to_json()}\n" for entry in entries).encode()


def beyond_keep_last(entries: Sequence[LedgerEntry], retention: Retention) -> list[LedgerEntry]:
    """`retention.job`'s entries older than its `keep_last` newest, oldest first."""
    mine = [entry for entry in entries if entry.job == retention.job and not entry.pruning]
    first: dict[str, int] = {}
    for position, entry in enumerate(mine):
        first.setdefault(entry.engine, position)
    mine.sort(key=lambda entry: (first[entry.engine], entry.seq))
    return mine[:-retention.keep_last]


def _parse_entry(line: bytes, is_checkpoint_name: Callable[[str], bool]) -> LedgerEntry | None:
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    job, name, engine = raw.get("job"), raw.get("name"), raw.get("engine")
    seq, manifest, pruning = raw.get("seq"), raw.get("manifest"), raw.get("pruning", False)
    if not (isinstance(job, str) and isinstance(engine, str) and isinstance(name, str)
            and is_checkpoint_name(name) and _is_int(seq) and isinstance(pruning, bool)):
        return None
    if isinstance(manifest, str) and manifest:
        return LedgerEntry(job, name, engine, seq, manifest, pruning)
    if isinstance(manifest, list) and len(manifest) == 2 and all(map(_is_int, manifest)):
        return LedgerEntry(job, name, engine, seq, (manifest[0], manifest[1]), pruning)
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
