"""`RangeCache`: one object's bytes, read through a node-local cache of its blocks.

The object (a `.bin` on a store) is cut into blocks of `block_bytes`. Under the cache
directory, beside the object's key:

- `<key>`: a sparse file the object's size, each cached block at its own offset (so a warm
  read is a copy out of a local file, as reading the object locally would be);
- `<key>.blocks`: the block table, mapped by every process on the node: a count of evictions
  and of blocks cached, then per block an entry (`version << 1 | cached`), a last-use tick
  and a claim (`pid << 32 | tick << 1 | started`: the process fetching it, since when, and
  whether the fetch started or is queued ahead);
  its header names the object's size and ETag and the machine's boot (a table of another
  version of the object, or from before a reboot, whose pages may not all have reached the
  disk, is replaced);
- `<key>.lock`: held (`flock`) while a process marks blocks cached or evicts them;
- `.asynctron-cache` at the directory's root: the whole directory's bytes cached, bytes
  fetched and requests (`object_cache_usage`).

Reads take no lock: they note the eviction count, check their blocks are cached (nothing to
check once every block is), copy, and check the count again; an eviction in between (the count
+ 1, the entries marked not cached, their versions + 1, then the holes punched, all under the
lock) makes them read again, so a read never returns bytes of a block evicted under it. A
fetch marks its blocks cached only if their versions are those it started with.
Missing blocks are fetched by runs (consecutive blocks, at most `request_bytes` per GET, all
in flight at once). A block is fetched once on the node: a process claims the blocks it will
fetch (under the lock) and releases them once stored or failed; a block being fetched by this
process is waited for, one another process is fetching is watched until it is cached or its
claim released (then fetched here), and prefetching skips it. A read takes over the blocks
another process only queued to fetch ahead (that queued fetch is then dropped), so a read
never waits behind someone else's prefetch. A claim whose process is gone, or older than
`_CLAIM_STALE_S`, counts for nothing.
Beyond the budget, the least recently used blocks of the object being stored are evicted. A
cache that cannot take a block (its disk full even after eviction) is bypassed: the read is
served from the store directly, never failed.

The files themselves are the local backend's (`storage/node_files/_cache_files.py`:
`SharedLock`, `SharedCounters`, `map_shared`, `BlockFile`): this module decides what is
cached, never how a file is opened, locked, mapped or punched.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from asynctron import _native
from asynctron._processes import boot_id, process_exists
from asynctron.datasets.object_cache._object_storage import naming_the_cache
from asynctron.storage.node_files import (
    BlockFile,
    SharedCounters,
    SharedLock,
    file_size,
    map_shared,
    read_head,
    replace_empty,
)

if TYPE_CHECKING:
    from asynctron.storage.backends import RangedFile

logger = logging.getLogger(__name__)
T = TypeVar("T")

_TABLE_MAGIC = b"ATRBLK04"
_ANY_TABLE = b"ATRBLK"  # every version's entries lie where this one's do
#: magic, block bytes, object bytes, ETag, the boot the table was made in
_TABLE_HEADER = struct.Struct("<8sQQ88s16s")
#: after the header, uint64 counters: evictions so far (readers check it did not move while
#: they copied), blocks cached (never above the truth, so "all cached" is safe to trust: a
#: store marks its blocks before counting them, an eviction counts before unmarking; a process
#: killed in between leaves the count low, which only costs the check it spares)
_EVICTIONS, _CACHED_BLOCKS = 0, 1
_ENTRIES_AT = _TABLE_HEADER.size + 16
_TOTALS_NAME = ".asynctron-cache"
_TOTALS_MAGIC = b"ATRTOT01"
#: the directory's totals (`SharedCounters` after the magic): bytes cached, fetched, requests
_CACHED, _FETCHED, _REQUESTS = 0, 1, 2
_TOTALS = 3
#: reads bigger than this share of the budget bypass the cache (they would evict themselves)
_BYPASS_SHARE = 8
#: evictions free the budget down to this share of it, so they come in batches
_EVICT_TO = 0.9
_ATTEMPTS = 8
#: fetches ahead of the reads (prefetch) in flight at once per object and process; the rest
#: queue, so a read's own fetch never waits behind a long horizon of them
_AHEAD_IN_FLIGHT = 16
#: fetches ahead queued at most, per object and process (~30 batches of 8 GPT samples); a
#: horizon beyond it is fetched when read
_MAX_QUEUED = 512

#: a claim this old is taken for abandoned (far beyond any store's deadline)
_CLAIM_STALE_S = 600.0
#: how often a reader looks at blocks another process is fetching: from the first to the most
_WATCH_FIRST_S, _WATCH_MOST_S = 0.0005, 0.01

_LIVE: weakref.WeakSet[RangeCache] = weakref.WeakSet()


@dataclass(frozen=True)
class ObjectCacheUsage:
    """What a cache directory holds and cost, summed over every process that used it."""

    bytes_cached: int
    bytes_fetched: int
    requests: int


def object_cache_usage(directory: str) -> ObjectCacheUsage:
    """The usage of the object cache `directory` (zeros if nothing was cached there)."""
    words = SharedCounters.read(os.path.join(directory, _TOTALS_NAME), _TOTALS_MAGIC, _TOTALS)
    return ObjectCacheUsage(int(words[_CACHED]), int(words[_FETCHED]), int(words[_REQUESTS]))


class _Closed(ValueError):
    """The cache was closed: a fetch still in flight is dropped; a read is an error, as on a
    closed file."""


@dataclass(eq=False)
class _Run:
    """Blocks `first : first + count`, fetched by one request (or queued to be)."""

    first: int
    count: int
    stored: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)
    started: bool = False
    ahead: bool = False  # started from the queue of fetches ahead
    claimed_started: bool = False  # its blocks' claims say it is being fetched


def _now() -> int:
    return int(time.monotonic() * 100) & 0xFFFFFFFF


_TICK_MASK = 0x7FFFFFFF


def _claim_of(started: bool) -> int:
    """This process's claim: `pid << 32 | tick << 1 | started`."""
    return (os.getpid() << 32) | ((_now() & _TICK_MASK) << 1) | int(started)


def blocks_of(offsets: np.ndarray, nbytes: np.ndarray, block_bytes: int) -> np.ndarray:
    """Every block the byte spans `offsets[i] : offsets[i] + nbytes[i]` touch (empty spans
    touch none), each at least once, in no particular order. `block_bytes`: a power of two."""
    if offsets.size and int(nbytes.min()) <= 0:
        keep = nbytes > 0
        offsets, nbytes = offsets[keep], nbytes[keep]
    if offsets.size == 0:
        return np.empty(0, np.int64)
    shift = block_bytes.bit_length() - 1
    first = offsets >> shift
    last = (offsets + nbytes - 1) >> shift
    counts = last - first + 1
    if int(counts.max()) <= 2:  # the common case: spans no longer than a block
        return np.concatenate((first, last))
    steps = np.ones(int(counts.sum()), np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    steps[starts] = first - np.concatenate(([0], last[:-1]))
    return np.cumsum(steps)


def _runs(blocks: np.ndarray, most: int) -> list[tuple[int, int]]:
    """`(first, count)` of the runs of consecutive `blocks` (sorted), each at most `most`."""
    if blocks.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    runs = []
    for run in np.split(blocks, breaks):
        for at in range(0, run.size, most):
            runs.append((int(run[at]), min(most, run.size - at)))
    return runs


class RangeCache:
    """The bytes of the object `source`, read through the cache file `path` (a `ReadableFile`
    itself).

    Reads are thread-safe, and safe across processes sharing the directory. A forked child
    gets locks and in-flight state of its own.
    """

    def __init__(self, source: RangedFile, path: str, root: str, *, budget_bytes: int,
                 block_bytes: int, request_bytes: int) -> None:
        self.source = source
        self.path = path
        self.nbytes = int(source.nbytes)
        self.block_bytes = block_bytes
        self.budget_bytes = budget_bytes
        self._request_blocks = max(1, request_bytes // block_bytes)
        self._bypass_bytes = max(budget_bytes // _BYPASS_SHARE, block_bytes)
        self._num_blocks = -(-self.nbytes // block_bytes)
        self._closed = False
        self._start_process()
        with naming_the_cache(root):
            self._lock = SharedLock(path + ".lock")
            self._totals = SharedCounters(os.path.join(root, _TOTALS_NAME), _TOTALS_MAGIC,
                                          _TOTALS)
            self._open_table()
        _LIVE.add(self)

    # -- files -------------------------------------------------------------------------------

    def _start_process(self) -> None:
        """Locks and in-flight state of this process (again in a forked child)."""
        self._thread_lock = threading.RLock()
        self._in_flight: dict[int, _Run] = {}
        self._queued: collections.deque[_Run] = collections.deque()
        self._ahead_in_flight = 0
        self._storer: concurrent.futures.ThreadPoolExecutor | None = None

    def _open_table(self) -> None:
        """Map the block table and the cache file, both started afresh unless they are this
        version's (of the object, its block size, and this boot of the machine: a table made
        before a reboot may mark blocks cached whose pages never reached the disk)."""
        header = _TABLE_HEADER.pack(_TABLE_MAGIC, self.block_bytes, self.nbytes,
                                    self.source.etag.encode()[:88], boot_id())
        n = self._num_blocks
        ticks_at = _ENTRIES_AT + 2 * n + (-(2 * n) % 8)
        claims_at = ticks_at + 4 * n + (-(4 * n) % 8)
        table_bytes = claims_at + 8 * n
        table_path = self.path + ".blocks"
        with self._locked():
            found = read_head(table_path, _TABLE_HEADER.size) or b""
            if not (found == header and file_size(table_path) == table_bytes
                    and file_size(self.path) == self.nbytes):
                self._replace(table_path, header, table_bytes, found)
            self._data_file = BlockFile(self.path, self.nbytes)
            self._table = map_shared(table_path, table_bytes)
        self._counters = np.frombuffer(self._table, np.uint64, 2, _TABLE_HEADER.size)
        self._entries = np.frombuffer(self._table, np.uint16, n, _ENTRIES_AT)
        self._ticks = np.frombuffer(self._table, np.uint32, n, ticks_at)
        self._claims = np.frombuffer(self._table, np.uint64, n, claims_at)
        self._data = self._data_file.map()
        self._bytes = np.frombuffer(self._data, np.uint8)

    def _replace(self, table_path: str, header: bytes, table_bytes: int, old: bytes) -> None:
        """Under the lock: a fresh, empty cache file and table for this version of the object
        (processes still reading the old ones keep them until they close)."""
        if old.startswith(_ANY_TABLE):  # forget what the old table counted as cached
            with contextlib.suppress(OSError, ValueError, struct.error):
                block_bytes, nbytes = struct.unpack_from("<QQ", old, 8)
                count = -(-nbytes // block_bytes)
                raw = read_head(table_path, _ENTRIES_AT + 2 * count) or b""
                entries = np.frombuffer(raw[_ENTRIES_AT:], np.uint16)
                self._add_totals(cached=-int(np.count_nonzero(entries & 1)) * block_bytes)
        replace_empty(self.path, self.nbytes, reserve=False)  # sparse: blocks come as read
        replace_empty(table_path, table_bytes, header, reserve=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The thread lock, then the file lock; `_Closed` once `close` gave the files back."""
        with self._thread_lock:
            if self._closed:
                raise _Closed(f"object cache {self.path}: closed")
            with self._lock:
                yield

    def _add_totals(self, *, cached: int = 0, fetched: int = 0, requests: int = 0) -> int:
        """Add to the directory's totals; returns its bytes cached."""
        def add(words: np.ndarray) -> None:
            words[_CACHED] = max(0, int(words[_CACHED]) + cached)
            words[_FETCHED] += fetched
            words[_REQUESTS] += requests

        return int(self._totals.update(add)[_CACHED])

    # -- reads -------------------------------------------------------------------------------

    def pread(self, nbytes: int, offset: int) -> bytes:
        """Blocks: up to `nbytes` bytes from `offset` (fewer at the object's end)."""
        nbytes = max(0, min(nbytes, self.nbytes - offset))
        if nbytes == 0:
            return b""
        spans = np.array([offset], np.int64), np.array([nbytes], np.int64)
        return self._serve(*spans, lambda: self._data[offset:offset + nbytes],
                           lambda: self.source.pread(nbytes, offset))

    def gather(self, dtype: np.dtype[Any], starts: np.ndarray, counts: np.ndarray,
               out: np.ndarray, destinations: np.ndarray) -> None:
        """Blocks: for each run `i`, tokens `starts[i] : starts[i] + counts[i]` (of `dtype`)
        as int64 into the flat `out` from element `destinations[i]` on."""
        itemsize = dtype.itemsize
        tokens = self._bytes[:self.nbytes - self.nbytes % itemsize].view(dtype)

        def from_cache() -> None:
            _native.gather_tokens(tokens, starts, counts, out, destinations)

        def from_store() -> None:
            flat = out.reshape(-1)
            for start, count, at in zip(starts.tolist(), counts.tolist(),
                                        destinations.tolist(), strict=True):
                data = self.source.pread(count * itemsize, start * itemsize)
                flat[at:at + count] = np.frombuffer(data, dtype, count)

        self._serve(starts * itemsize, counts * itemsize, from_cache, from_store)

    def prefetch(self, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        """Start fetching the missing blocks of these byte spans; returns at once (a failure
        is met again, and raised, by the read that needs them)."""
        if (int(nbytes.sum()) > self._bypass_bytes
                or int(self._counters[_CACHED_BLOCKS]) == self._num_blocks):
            return
        blocks = blocks_of(offsets, nbytes, self.block_bytes)
        missing = blocks[(self._entries[blocks] & 1) == 0]
        if missing.size:
            self._fetch(np.unique(missing), ahead=True)  # others' claims: theirs to fetch

    def _serve(self, offsets: np.ndarray, nbytes: np.ndarray, from_cache: Callable[[], T],
               from_store: Callable[[], T]) -> T:
        if int(nbytes.sum()) > self._bypass_bytes:
            return from_store()
        counters, blocks = self._counters, None
        for _ in range(_ATTEMPTS):
            evictions = int(counters[_EVICTIONS])
            if int(counters[_CACHED_BLOCKS]) != self._num_blocks:  # else: all cached
                if blocks is None:
                    blocks = blocks_of(offsets, nbytes, self.block_bytes)
                missing = blocks[(self._entries[blocks] & 1) == 0]
                if missing.size:
                    fetches, others = self._fetch(np.unique(missing))
                    if not all(fetch.result() for fetch in fetches):
                        return from_store()  # the cache could not take them: disk full
                    self._watch(others)
                    continue
            result = from_cache()
            if int(counters[_EVICTIONS]) == evictions:  # nothing evicted while we copied
                if blocks is not None:
                    self._ticks[blocks] = _now()
                return result
        return from_store()  # evicted under us again and again: a budget too small

    # -- fetches -----------------------------------------------------------------------------

    def _fetch(self, missing: np.ndarray, *, ahead: bool = False
               ) -> tuple[set[concurrent.futures.Future[bool]], np.ndarray]:
        """Futures (True: stored) covering the blocks of `missing` this process fetches, and
        the blocks another process is fetching (claimed: see `_watch`). A read's blocks are
        fetched at once, jumping the queue of fetches ahead (`ahead`), which run at most
        `_AHEAD_IN_FLIGHT` at a time, oldest first."""
        waits: set[concurrent.futures.Future[bool]] = set()
        starting: list[_Run] = []
        others = np.empty(0, np.int64)
        with self._thread_lock:
            new = []
            for block in missing.tolist():
                run = self._in_flight.get(block)
                if run is None:
                    new.append(block)
                    continue
                waits.add(run.stored)
                if not ahead and not run.started:  # queued ahead, needed now
                    run.started = True
                    starting.append(run)
            claimed = np.asarray(new, np.int64)
            if claimed.size:
                claimed, others = self._claim(claimed, started=not ahead)
            for first, count in _runs(claimed, self._request_blocks):
                run = _Run(first, count)
                for block in range(first, first + count):
                    self._in_flight[block] = run
                waits.add(run.stored)
                if ahead:
                    if len(self._queued) >= _MAX_QUEUED:  # far enough ahead: read on demand
                        for block in range(first, first + count):
                            del self._in_flight[block]
                        waits.discard(run.stored)
                        self._release(first, count)
                        continue
                    self._queued.append(run)
                else:
                    run.started = run.claimed_started = True
                    starting.append(run)
            starting += self._take_queued()
        for run in starting:
            self._start(run)
        return waits, others

    def _claim(self, blocks: np.ndarray, *, started: bool) -> tuple[np.ndarray, np.ndarray]:
        """Under the thread lock: claim for this process those of `blocks` (sorted) that are
        not cached and that no other live process is fetching (`started`: a read's, fetched
        now, which also takes blocks others only queued to fetch ahead); returns (claimed,
        being fetched by others)."""
        with self._locked():
            uncached = blocks[(self._entries[blocks] & 1) == 0]
            claims = self._claims[uncached]
            theirs = self._live_claims(claims, started_only=started) & (
                (claims >> 32) != os.getpid())
            mine = uncached[~theirs]
            self._claims[mine] = _claim_of(started)
        return mine, uncached[theirs]

    def _start_claims(self, run: _Run) -> bool:
        """Mark `run`'s claims started (it is about to be fetched); False if another process's
        read took any of its blocks meanwhile (the run is then dropped)."""
        with self._locked():
            claims = self._claims[run.first:run.first + run.count]
            if not bool(((claims >> 32) == os.getpid()).all()):
                return False
            claims[:] = _claim_of(started=True)
        return True

    def _live_claims(self, claims: np.ndarray, *, started_only: bool) -> np.ndarray:
        """Which of `claims` stand: made (and `started`, if asked), by a process still alive,
        within `_CLAIM_STALE_S`."""
        live = claims != 0
        if started_only:
            live &= (claims & 1) == 1
        if live.any():
            age = (_now() - ((claims >> 1) & _TICK_MASK)) & _TICK_MASK
            live &= age < int(_CLAIM_STALE_S * 100)
            for pid in np.unique(claims[live] >> 32).tolist():
                if not process_exists(int(pid)):
                    live &= (claims >> 32) != pid
        return live

    def _release(self, first: int, count: int) -> None:
        """Drop this process's claims on blocks `first : first + count` (stored or failed)."""
        with self._locked():
            claims = self._claims[first:first + count]
            claims[(claims >> 32) == os.getpid()] = 0

    def _watch(self, blocks: np.ndarray) -> None:
        """Blocks: until each of `blocks` (claimed by other processes) is cached, or its claim
        released or abandoned (the caller then fetches it)."""
        delay = _WATCH_FIRST_S
        while blocks.size:
            blocks = blocks[(self._entries[blocks] & 1) == 0]
            blocks = blocks[self._live_claims(self._claims[blocks], started_only=True)]
            if blocks.size:
                time.sleep(delay)
                delay = min(2 * delay, _WATCH_MOST_S)

    def _take_queued(self) -> list[_Run]:
        """Under the lock: the queued runs that may start now."""
        taken = []
        while self._queued and self._ahead_in_flight < _AHEAD_IN_FLIGHT:
            run = self._queued.popleft()
            if not run.started:
                run.started = run.ahead = True
                self._ahead_in_flight += 1
                taken.append(run)
        return taken

    def _start(self, run: _Run) -> None:
        if not run.claimed_started and not self._start_claims(run):
            run.stored.set_result(True)  # another process's read is fetching them
            self._forget(run)
            return
        offset = run.first * self.block_bytes
        buffer = np.empty(min(run.count * self.block_bytes, self.nbytes - offset), np.uint8)
        versions = self._entries[run.first:run.first + run.count] >> 1
        storer = self._storer_of_this_process()
        try:
            fetched = self.source.fetch([(offset, memoryview(buffer))])
        except BaseException as error:
            run.stored.set_exception(error)
            self._forget(run)
            return
        def store(done: concurrent.futures.Future[None]) -> None:  # on the S3 I/O loop
            try:
                storer.submit(self._store, run, buffer, versions, done)
            except RuntimeError as error:  # the interpreter is shutting down
                run.stored.set_exception(error)
                self._forget(run)

        fetched.add_done_callback(store)

    def _storer_of_this_process(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._storer is None:
            self._storer = concurrent.futures.ThreadPoolExecutor(
                2, thread_name_prefix="asynctron-range-cache")
        return self._storer

    def _forget(self, run: _Run) -> None:
        """`run` is over: its blocks are no longer in flight (nor claimed); queued runs may
        start."""
        with self._thread_lock:
            if not self._closed:
                self._release(run.first, run.count)
            for block in range(run.first, run.first + run.count):
                if self._in_flight.get(block) is run:
                    del self._in_flight[block]
            if run.ahead:
                self._ahead_in_flight -= 1
            starting = self._take_queued()
        for queued in starting:
            self._start(queued)

    def _store(self, run: _Run, buffer: np.ndarray, versions: np.ndarray,
               fetched: concurrent.futures.Future[None]) -> None:
        """On a storer thread: write a fetched run into the cache file and mark it cached."""
        first, count, stored = run.first, run.count, run.stored
        try:
            error = fetched.exception()
            if error is not None:
                stored.set_exception(error)
                return
            written = self._write(first * self.block_bytes, buffer)
            with self._locked():
                end = first + count
                entries = self._entries[first:end]
                fresh = ((entries >> 1) == versions) & ((entries & 1) == 0)
                added = int(np.count_nonzero(fresh)) if written else 0
                if added:
                    entries[fresh] |= 1
                    self._ticks[first:end] = _now()
                    self._counters[_CACHED_BLOCKS] += added
                # blocks evicted since the fetch started stay uncached (their bytes may lie
                # there unaccounted until the block is fetched again: never zeros served)
                cached = self._add_totals(cached=added * self.block_bytes,
                                          fetched=buffer.nbytes, requests=1)
                if cached > self.budget_bytes:
                    self._evict(cached - int(self.budget_bytes * _EVICT_TO))
            stored.set_result(written)
        except _Closed:
            stored.set_result(False)  # closed meanwhile: dropped, as `close` says
        except BaseException as error:
            stored.set_exception(error)
        finally:
            self._forget(run)

    def _write(self, offset: int, buffer: np.ndarray) -> bool:
        """Write `buffer` at `offset` of the cache file; on a full disk evict half of this
        object's cached blocks and try once more. False: the cache cannot take it."""
        for attempt in range(2):
            try:
                with self._thread_lock:  # never into a descriptor `close` gave back
                    if self._closed:
                        return False
                    self._data_file.write(memoryview(buffer), offset)
                return True
            except OSError as error:
                if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or attempt:
                    logger.warning("object cache %s: %s; serving from the store", self.path,
                                   error)
                    return False
                with self._locked():
                    cached = int(np.count_nonzero(self._entries & 1)) * self.block_bytes
                    self._evict(max(self.block_bytes, cached // 2))
        return False

    # -- eviction ----------------------------------------------------------------------------

    def _evict(self, nbytes: int) -> None:
        """Under the lock: evict this object's least recently used blocks, `nbytes` of them
        (or all it has)."""
        cached = np.flatnonzero(self._entries & 1)
        count = min(cached.size, -(-nbytes // self.block_bytes))
        if count <= 0:
            return
        if count < cached.size:
            oldest = np.argpartition(self._ticks[cached], count - 1)[:count]
            victims = np.sort(cached[oldest])
        else:
            victims = cached
        self._counters[_EVICTIONS] += 1  # before the holes: readers copying now read again
        self._counters[_CACHED_BLOCKS] -= count
        entries = self._entries[victims]
        self._entries[victims] = (((entries >> 1) + 1) & 0x7FFF) << 1
        for first, n in _runs(victims, self._num_blocks):
            self._punch(first, n)
        self._add_totals(cached=-count * self.block_bytes)

    def _punch(self, first: int, count: int) -> None:
        offset = first * self.block_bytes
        self._data_file.punch(offset, min(count * self.block_bytes, self.nbytes - offset))

    def close(self) -> None:
        """Release the files (what is cached stays for the next reader); fetches still in
        flight are dropped when they land."""
        with getattr(self, "_thread_lock", contextlib.nullcontext()):
            self._closed = True
            for name in ("_data_file", "_lock", "_totals"):
                if hasattr(self, name):
                    getattr(self, name).close()

    def __del__(self) -> None:
        self.close()


def _reopen_in_child() -> None:
    for cache in list(_LIVE):
        cache._start_process()
        if not cache._closed:
            try:
                cache._lock.reopen()
                cache._totals.reopen()
            except OSError as error:  # out of descriptors: this cache only is given up
                logger.warning("object cache %s: not reopened in the forked child: %s",
                               cache.path, error)
                cache.close()


os.register_at_fork(after_in_child=_reopen_in_child)
