"""`EngineConfig`: how an engine saves and loads (its workers, bins, memory, checksums, tiers),
validated at construction; `EngineOptions`, the same fields as `Engine(...)` keywords."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from asynctron.engine.tiers._config import Tiers
from asynctron.storage import Backend
from asynctron.storage.backends import RangedFiles
from asynctron.storage.format import ALGORITHMS, ALIGN_BYTES, XXH3_64

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The engine's knobs, validated at construction."""

    num_workers: int = 4
    """Threads in the engine's executor: every file syscall, memcpy and CUDA wait runs there."""
    num_bins: int = 2
    """Files written per save (per rank), each by its own writer task."""
    memory_budget_bytes: int = 2048 * MiB
    """Most bytes of staging slabs held at once; a bigger state dict streams through in waves."""
    slab_bytes: int = 64 * MiB
    """Size of one staging slab = one write call = one read call."""
    keep_last: int | None = None
    """After each commit, delete this job's checkpoints in the same directory beyond the
    newest `keep_last` (None: keep all). Only checkpoints this job committed are candidates,
    never what `latest` names nor one being loaded (see `job`)."""
    job: str | None = None
    """The name of the training job, the same across its restarts, for `keep_last`: pruning
    also takes the checkpoints committed under this name before a restart (or by another
    engine of the job). None: only this engine's own commits."""
    pin_memory: bool | None = None
    """Pin staging slabs (page-locked, for fast D2H/H2D); None: once this process uses CUDA
    (`torch.cuda.is_initialized()` when a slab is taken), so saves of a CPU-only trainer on a
    GPU machine never start a CUDA context."""
    direct_io: bool = True
    """Write whole slabs with O_DIRECT (bypassing the page cache) where the filesystem allows
    it; elsewhere (tmpfs) and for unaligned tails, buffered writes are used."""
    checksum: str | None = XXH3_64
    """Digest every item while staging it (`"xxh3_64"`), or `None` for no checksums (loads
    then have nothing to verify)."""
    coordination_timeout_s: float = 1800.0
    """Across ranks: how long a rank waits in the save protocol's collectives for the others
    (at the end of a save, for the slowest rank's writes) before raising `PeerTimeoutError`.
    A rank that dies is noticed at once; this bounds a rank that hangs."""
    worker_nice_increment: int = 10
    """How much lower the CPU priority of the executor's threads is than the thread that
    starts the engine (added to its nice value, Linux only): when the event loop or training
    wakes up, it gets a core before checkpoint copies and writes do. 0 leaves it alone."""
    tiers: Tiers | None = None
    """Save to tiers (`save(state, step=N)`: the node's local tier, replicas on other nodes,
    a store in the background) and `restore` from the nearest that verifies; see `Tiers`."""
    share_reads: bool | None = None
    """In collective loads (and the tiers' restore from the store), read each stored item once
    per job, by one of the ranks that need it, and send it to the others over torch.distributed
    (replicated state is then read once, not once per rank). None: on object stores, where
    every byte read costs the store's bandwidth; not on local paths, whose ranks on a node
    share the page cache."""

    def shares_reads(self, backend: Backend) -> bool:
        """Whether collective loads from `backend` read each item once per job: `share_reads`,
        or by default whether `backend` is an object store (`RangedFiles`)."""
        return (isinstance(backend, RangedFiles) if self.share_reads is None
                else self.share_reads)

    def __post_init__(self) -> None:
        for name in ("num_workers", "num_bins"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, found {value!r}")
        if not isinstance(self.slab_bytes, int) or self.slab_bytes < ALIGN_BYTES or (
                self.slab_bytes % ALIGN_BYTES):
            raise ValueError(f"slab_bytes: expected a multiple of {ALIGN_BYTES} >= "
                             f"{ALIGN_BYTES}, found {self.slab_bytes!r}")
        if not isinstance(self.memory_budget_bytes, int) or (
                self.memory_budget_bytes < self.slab_bytes):
            raise ValueError(f"memory_budget_bytes: expected an int >= slab_bytes "
                             f"({self.slab_bytes}), found {self.memory_budget_bytes!r}; "
                             "lower slab_bytes or raise the budget")
        if isinstance(self.coordination_timeout_s, bool) or not isinstance(
                self.coordination_timeout_s, int | float) or not self.coordination_timeout_s > 0:
            raise ValueError(f"coordination_timeout_s: expected a number of seconds > 0, found "
                             f"{self.coordination_timeout_s!r}")
        if not isinstance(self.worker_nice_increment, int) or not (
                0 <= self.worker_nice_increment <= 19):
            raise ValueError(f"worker_nice_increment: expected an int in [0, 19], found "
                             f"{self.worker_nice_increment!r}")
        if self.checksum not in ALGORITHMS:
            raise ValueError(f"checksum: expected one of {sorted(map(str, ALGORITHMS))}, "
                             f"found {self.checksum!r}")
        if self.keep_last is not None and (not isinstance(self.keep_last, int)
                                           or self.keep_last < 1):
            raise ValueError(f"keep_last: expected None or an int >= 1, found "
                             f"{self.keep_last!r}")
        if self.job is not None and not (isinstance(self.job, str) and 0 < len(self.job) <= 256
                                         and self.job.isprintable()):
            raise ValueError(f"job: expected None or a printable name of 1 to 256 characters, "
                             f"found {self.job!r}")
        if self.share_reads is not None and not isinstance(self.share_reads, bool):
            raise ValueError(f"share_reads: expected None, True or False, found "
                             f"{self.share_reads!r}")
        if self.tiers is not None and not isinstance(self.tiers, Tiers):
            raise TypeError(f"tiers: expected asynctron.Tiers or None, found "
                            f"{type(self.tiers).__name__}")


class EngineOptions(TypedDict, total=False):
    """`EngineConfig`'s fields as keywords: `Engine(num_workers=2)` is
    `Engine(config=EngineConfig(num_workers=2))`."""

    num_workers: int
    num_bins: int
    memory_budget_bytes: int
    slab_bytes: int
    keep_last: int | None
    job: str | None
    pin_memory: bool | None
    direct_io: bool
    checksum: str | None
    coordination_timeout_s: float
    worker_nice_increment: int
    tiers: Tiers | None
    share_reads: bool | None
