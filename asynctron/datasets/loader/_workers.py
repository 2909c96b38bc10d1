"""`BatchWorkers`: long-lived worker processes that write whole batches into shared slabs.

The trainer's process does O(1) work per batch, none of it a blocking call: the batch's data
is read, cut and collated in a worker, under the worker's own GIL; the loop learns of it from
a 16-byte record. The loop asks for batch `k` by writing its slab number into a ring in shared
memory and releasing worker `k % num_workers`'s semaphore (neither releases the GIL), and it
reads the records without releasing the GIL either (`_native.read_nowait`), and is woken by
them only when its consumer waits: with a trainer thread busy in Python, every release of the
GIL costs the loop up to a switch interval (5 ms) to get it back, and every wake-up takes the
GIL from the trainer.

A worker also advises the kernel to read the pages of its coming batches (`WILLNEED`), as far
ahead as the loader's prefetch budget lets it (the loop moves that horizon), and starts
fetching the ranges of its next `FETCH_AHEAD_BATCHES` batches from an object store (a dataset
on `s3://`, into its node-local cache).

Worker `w` writes batches `w, w + n, w + 2n, ...` in order; batch `k` holds samples
`start + k * samples_per_step + [0, micro_batch_size)`, `start` set when iteration begins.

An error a worker raises on a batch travels as itself: pickled into the batch's record
(`report_error`), raised to the consumer with its type, message and attributes, the worker's
traceback text chained as `__cause__` (`raised_in_worker`). Pickle crosses only between the
loader's process and the workers it started, which run its dataset's code anyway: the pipe is
the loader's own, and nothing else writes to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import struct
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch

from asynctron import _native
from asynctron._budget import ByteBudget
from asynctron._concurrency import RunBlocking
from asynctron.datasets.loader import _pages
from asynctron.datasets.loader._batches import BatchLayout
from asynctron.datasets.loader._busy_cores import BusyCoreAvoidance
from asynctron.datasets.loader._shared_slabs import SharedSlabs, SlabFile
from asynctron.datasets.loader._wake_pacing import WakePacing
from asynctron.errors import LoaderWorkerError, WouldBlock

logger = logging.getLogger(__name__)

#: batches of its own a worker fetches ahead from an object store (datasets on `s3://`),
#: within the advised horizon: a few are enough to hide a request's latency, more would only
#: compete for the store with the batch being written
FETCH_AHEAD_BATCHES = 8

# the control block, int64 words in shared memory
_STOP = 0  # 1: workers exit at their next wake-up
_START = 1  # the first sample of batch 0 (this rank's)
_HORIZON = 2  # the last batch whose pages may be advised
_RING = 3  # the slab of batch k is at _RING + k % ring_size

#: a worker's report of one batch: batch, worker, when it was written (`time.monotonic`),
#: bytes of the error report that follow (0: done)
RECORD = struct.Struct("<qidI")
#: the most bytes of an error report, so a record is one atomic pipe write
MAX_ERROR_BYTES = 4096 - RECORD.size
#: an error report: bytes of the error's description ("module.Type: message"), of why it is
#: not raised as itself (0: it is pickled), and of its pickle; then those, then the end of its
#: traceback text
ERROR_HEAD = struct.Struct("<HHH")
#: the most bytes of an error's description, and of why it is not pickled
MAX_DESCRIPTION_BYTES = 512
MAX_REASON_BYTES = 256
#: the least room a pickled error leaves for the traceback text (a larger pickle is not sent)
MIN_TRACEBACK_BYTES = 1024
#: how often an idle worker checks that the loader's process is alive
PARENT_CHECK_S = 1.0
#: how long `aclose` waits for workers to exit before killing them
EXIT_TIMEOUT_S = 5.0


def _serve(index: int, num_workers: int, dataset: Any, layout: BatchLayout,
           slab_file: SlabFile, control_words: Any, semaphore: Any, done: Any,
           niceness: int, parent: int, micro_batch_size: int, samples_per_step: int,
           away_within: frozenset[int] | None) -> None:
    """A worker's life: wait for a batch, advise the coming ones, write it, report; with
    `away_within`, stay on those CPUs but off the ones where the parent's busy threads run."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the loader's process stops us
    with contextlib.suppress(OSError):  # below the inherited level needs privilege: keep it
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    torch.set_num_threads(1)
    memory = slab_file.map()
    control = np.frombuffer(control_words, np.int64)
    ring_size = control.size - _RING
    slab_bytes = layout.slab_bytes
    done_fd = done.fileno()
    offsets = np.arange(micro_batch_size, dtype=np.int64)
    batch, advised = index, index - num_workers
    fetched = advised  # the last batch whose object-store ranges were asked for
    located: dict[int, Any] = {}  # batches advised ahead, not yet written
    avoidance = None if away_within is None else BusyCoreAvoidance(parent, away_within)
    fetch_ahead = getattr(dataset, "fetch_ahead", None)  # ranges of datasets on a store
    while True:
        if avoidance is not None:
            avoidance.look()
        if not semaphore.acquire(timeout=PARENT_CHECK_S):
            if os.getppid() != parent:
                return
            continue
        if control[_STOP]:
            return
        start = int(control[_START])
        coming = []
        for ahead in range(max(advised + num_workers, batch), int(control[_HORIZON]) + 1,
                           num_workers):
            advised = ahead
            try:
                located[ahead] = dataset.locate_batch(start + ahead * samples_per_step + offsets)
                coming.append(dataset.token_ranges(located[ahead]))
            except Exception:  # reported when that batch's own turn comes
                continue
        if coming:
            with contextlib.suppress(OSError):  # advice only
                _pages.advise_willneed(_pages.page_ranges_of(
                    np.concatenate([addresses for addresses, _ in coming]),
                    np.concatenate([nbytes for _, nbytes in coming]),
                    max_gap_bytes=_pages.READ_GAP_BYTES))
        if fetch_ahead is not None:  # from a store: the next few advised batches
            for ahead in range(max(fetched + num_workers, batch),
                               batch + FETCH_AHEAD_BATCHES * num_workers, num_workers):
                if ahead not in located:
                    break
                fetched = ahead
                with contextlib.suppress(Exception):  # met again when the batch is written
                    fetch_ahead(located[ahead])
        try:
            this = located.pop(batch, None)
            if this is None:  # beyond the budget's horizon: not advised
                this = dataset.locate_batch(start + batch * samples_per_step + offsets)
            slab = int(control[_RING + batch % ring_size])
            dataset.write_samples(this, layout.arrays(memory, slab * slab_bytes))
            error = b""
        except Exception as exc:
            error = report_error(exc)
        os.write(done_fd, RECORD.pack(batch, index, time.monotonic(), len(error)) + error)
        batch += num_workers


class BatchWorkers:
    """`num_workers` processes writing batches of `dataset` into `slabs`.

    Args:
        dataset: a dataset with `batch_fields`, `locate_batch`, `token_ranges` and
            `write_samples` (`GPTDataset`, `BlendedDataset`).
        layout: its batch layout; `slabs`: where batches are written.
        ring_size: the most batches asked for and not yet consumed, plus one.
        budget, read_bytes_per_batch: pages are advised ahead while the budget lends
            `read_bytes_per_batch` per batch; given back when the batch is written.
        start_method: `multiprocessing` start method ("fork" starts in milliseconds;
            "spawn" and "forkserver" pickle the dataset, which reopens its files).
        niceness: the workers' nice level.
        cpus: the CPUs the workers may run on (None: wherever the scheduler puts them;
            "away": this process's CPUs but those where its busy threads run, followed as
            they move).
        on_progress: called on the loop after batches finished (or failed), once per
            wake-up.

    Concurrency: one event loop; every method on its thread.
    """

    def __init__(self, dataset: Any, layout: BatchLayout, slabs: SharedSlabs, *,
                 num_workers: int, ring_size: int, micro_batch_size: int,
                 samples_per_step: int, budget: ByteBudget, read_bytes_per_batch: int,
                 start_method: str, niceness: int, cpus: frozenset[int] | Literal["away"] | None,
                 on_progress: Callable[[], None]) -> None:
        self.num_workers = num_workers
        self._layout = layout
        self._slabs = slabs
        self._budget = budget
        self._read_bytes = read_bytes_per_batch
        self._on_progress = on_progress
        context = multiprocessing.get_context(start_method)
        self._control_words = context.RawArray("q", _RING + ring_size)
        self._control = np.frombuffer(self._control_words, np.int64)
        self._control[_HORIZON] = -1
        self._ring_size = ring_size
        self._semaphores = [context.Semaphore(0) for _ in range(num_workers)]
        self._reader, writer = context.Pipe(duplex=False)
        # "away": each worker binds itself as it goes; a fixed set is bound once, at start
        away_within = frozenset(os.sched_getaffinity(0)) if cpus == "away" else None
        self._cpus = None if cpus == "away" else cpus
        self._processes = [context.Process(
            target=_serve, name=f"asynctron-loader-{i}", daemon=True,
            args=(i, num_workers, dataset, layout, slabs.file, self._control_words,
                  self._semaphores[i], writer, niceness, os.getpid(), micro_batch_size,
                  samples_per_step, away_within)) for i in range(num_workers)]
        self._writer = writer
        self._waiting: dict[int, tuple[asyncio.Future[dict[str, torch.Tensor]], int]] = {}
        self._borrowed: set[int] = set()
        self._horizon = -1
        self._num_batches = 0
        self._unparsed = b""
        self._watching = False
        #: whether the loop's wake-ups wait for another thread's GIL (from the records' age)
        self.pacing = WakePacing()
        self._failure: LoaderWorkerError | None = None
        self._exited: list[asyncio.Future[None]] = []
        self._reaping: list[asyncio.Future[None]] = []
        self._run_blocking: RunBlocking | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, run_blocking: RunBlocking) -> None:
        """Start the processes, off the loop (a fork copies the page tables), from a thread of
        their own: a child forked from an executor's thread would try to join itself at
        exit."""
        self._loop = asyncio.get_running_loop()
        self._run_blocking = run_blocking
        started: asyncio.Future[None] = self._loop.create_future()
        threading.Thread(target=self._start_all, args=(self._loop, started),
                         name="asynctron-loader-start", daemon=True).start()
        await started
        self._writer.close()
        os.set_blocking(self._reader.fileno(), False)
        for i, process in enumerate(self._processes):
            self._exited.append(self._loop.create_future())
            self._loop.add_reader(process.sentinel, self._on_exit, i)

    def _start_all(self, loop: asyncio.AbstractEventLoop, started: asyncio.Future[None]) -> None:
        try:
            for process in self._processes:
                process.start()
                if self._cpus is not None:  # in force before `start` returns
                    os.sched_setaffinity(process.pid, self._cpus)
        except BaseException as error:
            loop.call_soon_threadsafe(_settle, started, error)
        else:
            loop.call_soon_threadsafe(_settle, started, None)

    def begin(self, start: int, num_batches: int) -> None:
        """Batch 0 starts at sample `start`; there are `num_batches`."""
        self._control[_START] = start
        self._num_batches = num_batches
        self._extend_horizon()

    def submit(self, batch: int) -> asyncio.Future[dict[str, torch.Tensor]]:
        """Ask for `batch`; the future gets its tensors (in a slab lent to them)."""
        assert self._loop is not None
        future: asyncio.Future[dict[str, torch.Tensor]] = self._loop.create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        slab = self._slabs.take()
        self._control[_RING + batch % self._ring_size] = slab
        self._waiting[batch] = (future, slab)
        self._semaphores[batch % self.num_workers].release()
        return future

    def _extend_horizon(self) -> None:
        """Let the workers advise further batches while the budget lends the bytes."""
        while self._horizon + 1 < self._num_batches:
            try:
                self._budget.acquire_nowait(self._read_bytes)
            except WouldBlock:
                break
            self._horizon += 1
            self._borrowed.add(self._horizon)
        self._control[_HORIZON] = self._horizon

    def poll(self) -> None:
        """Take in the records the workers wrote so far (no wait, the GIL kept)."""
        self._take_records()

    def watch(self) -> None:
        """Wake the loop at the next record (once): for a consumer about to wait. Records
        that come while nobody waits stay in the pipe until `poll`, so a consumer that finds
        its batches ready costs the loop no wake-up (each one takes the GIL from a busy
        trainer)."""
        assert self._loop is not None
        if not self._watching:
            self._watching = True
            self._loop.add_reader(self._reader.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._loop is not None
        self._watching = False
        self._loop.remove_reader(self._reader.fileno())
        first_written_at = self._take_records()
        if first_written_at is not None:
            self.pacing.woke(time.monotonic() - first_written_at)

    def _take_records(self) -> float | None:
        """Take in the records in the pipe; when the first of them was written (None:
        none)."""
        data = _native.read_nowait(self._reader.fileno(), 1 << 16)
        if not data:
            return None  # None: every worker is gone (their exits report it)
        data = self._unparsed + data
        at = 0
        first_written_at = None
        while len(data) - at >= RECORD.size:
            batch, worker, written_at, error_bytes = RECORD.unpack_from(data, at)
            if len(data) - at < RECORD.size + error_bytes:
                break
            error = data[at + RECORD.size:at + RECORD.size + error_bytes]
            at += RECORD.size + error_bytes
            if first_written_at is None:
                first_written_at = written_at
            self._finish(batch, worker, error)
        self._unparsed = data[at:]
        self._extend_horizon()
        self._on_progress()
        return first_written_at

    def _finish(self, batch: int, worker: int, error: bytes) -> None:
        if batch in self._borrowed:
            self._borrowed.discard(batch)
            self._budget.release(self._read_bytes)
        future, slab = self._waiting.pop(batch)
        if error:
            self._slabs.give_back(slab)
            if not future.done():
                future.set_exception(raised_in_worker(
                    error, worker=worker, batch=batch,
                    first_sample=int(self._control[_START])))
        elif not future.done():
            future.set_result(self._layout.batch(self._slabs.lend(slab)))
        else:
            self._slabs.give_back(slab)

    def _on_exit(self, worker: int) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._processes[worker].sentinel)
        self._reaping.append(asyncio.ensure_future(self._reap(worker)))

    async def _reap(self, worker: int) -> None:
        """Collect an exited worker (off the loop: its exit status may lag its sentinel) and,
        unless we stopped it, fail the batches waiting on it."""
        process = self._processes[worker]
        assert self._run_blocking is not None
        await self._run_blocking(process.join)
        self._exited[worker].set_result(None)
        if self._control[_STOP] or self._failure is not None:
            return
        self._take_records()  # what it reported before it died
        code = process.exitcode
        how = (f"was killed by signal {signal.Signals(-code).name}"
               if code is not None and code < 0 else f"exited with code {code}")
        self._failure = LoaderWorkerError(
            f"loader worker {worker} (pid {process.pid}) {how}; the batches it was writing are "
            "lost (a traceback on stderr, or the kernel log for a kill, says why)",
            worker=worker,
            batch=min((b for b in self._waiting if b % self.num_workers == worker),
                      default=None))
        for future, _ in self._waiting.values():
            if not future.done():
                future.set_exception(self._failure)
        self._on_progress()

    async def aclose(self) -> None:
        """Stop the workers (killing those that do not exit in `EXIT_TIMEOUT_S`) and give
        back the budget. Batches already handed out stay valid."""
        self._control[_STOP] = 1
        for semaphore in self._semaphores:
            semaphore.release()
        if self._exited:
            _, late = await asyncio.wait(self._exited, timeout=EXIT_TIMEOUT_S)
            for worker, future in enumerate(self._exited):
                if future in late:
                    logger.warning("loader worker %d did not exit in %.0f s; killing it",
                                   worker, EXIT_TIMEOUT_S)
                    self._processes[worker].kill()
            if late:
                await asyncio.wait(late)
            await asyncio.gather(*self._reaping)
        if self._loop is not None and self._watching:
            self._loop.remove_reader(self._reader.fileno())
        self._reader.close()
        self._budget.release(self._read_bytes * len(self._borrowed))
        self._borrowed.clear()
        for future, slab in self._waiting.values():
            self._slabs.give_back(slab)
            future.cancel()
        self._waiting.clear()
        self._slabs.close()

    @property
    def pids(self) -> list[int | None]:
        return [process.pid for process in self._processes]


class _RemoteTraceback(Exception):
    """A worker's traceback text, chained as `__cause__` of the error it raised (as
    `concurrent.futures.ProcessPoolExecutor` does), so a printed error shows where in the
    worker it began."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""'


def report_error(error: Exception) -> bytes:
    """What a worker sends of `error`, at most `MAX_ERROR_BYTES` (`ERROR_HEAD`): its
    description; the error pickled, when it pickles and leaves `MIN_TRACEBACK_BYTES` of room,
    or else why not; and the end of its traceback text in the room left (its last line, the
    error's message, cut as the description is)."""
    description = _bounded(_describe(error), MAX_DESCRIPTION_BYTES)
    room = MAX_ERROR_BYTES - ERROR_HEAD.size - len(description) - MIN_TRACEBACK_BYTES
    reason = ""
    try:
        pickled = pickle.dumps(error, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        pickled = b""
        reason = f"it does not pickle ({_describe(exc)}); make the exception picklable"
    if len(pickled) > room:
        reason = (f"its pickle is {len(pickled)} bytes, over the {room} a worker's report has "
                  "room for; keep large values out of the exception")
        pickled = b""
    why = _bounded(reason, MAX_REASON_BYTES)
    head = ERROR_HEAD.pack(len(description), len(why), len(pickled))
    room = MAX_ERROR_BYTES - len(head) - len(description) - len(why) - len(pickled)
    text = "".join(traceback.format_exception(error)).encode(errors="replace")
    last = "".join(traceback.format_exception_only(error)).encode(errors="replace")
    if len(last) > MAX_DESCRIPTION_BYTES and text.endswith(last):  # keep the frames above it
        text = text[:-len(last)] + _bounded(last.decode(errors="replace"),
                                            MAX_DESCRIPTION_BYTES) + b"\n"
    if len(text) > room:
        cut = b"[...]\n"
        text = cut + text[len(text) - room + len(cut):]
    return head + description + why + pickled + text


def raised_in_worker(report: bytes, *, worker: int, batch: int, first_sample: int) -> Exception:
    """The error for the consumer from a worker's `report_error`: the worker's own error,
    unpickled, with a note naming the worker and the batch; or, where it cannot be raised as
    itself (it does not pickle within the bound, or unpickle here, or is a StopIteration or
    StopAsyncIteration, which would end the consumer's loop), a `LoaderWorkerError` naming its
    type, message and why. Either way `__cause__` is a `_RemoteTraceback` holding the worker's
    traceback text. Never raises."""
    description_bytes, why_bytes, pickle_bytes = ERROR_HEAD.unpack_from(report)
    at = ERROR_HEAD.size
    description = report[at:at + description_bytes].decode(errors="replace")
    at += description_bytes
    reason = report[at:at + why_bytes].decode(errors="replace")
    at += why_bytes
    pickled = report[at:at + pickle_bytes]
    remote = _RemoteTraceback(report[at + pickle_bytes:].decode(errors="replace"))
    samples = f"samples from {first_sample} + {batch} steps"
    where = f"loader worker {worker} failed on batch {batch} ({samples})"
    if pickled:
        try:
            error = pickle.loads(pickled)
        except Exception as exc:
            reason = (f"it does not unpickle here ({_describe(exc)}); make the exception "
                      "unpickle to itself (its args rebuild it, or give it a `__reduce__`)")
        else:
            if isinstance(error, StopIteration | StopAsyncIteration):
                reason = "raised as itself it would end the consumer's `async for`"
            elif not isinstance(error, Exception):
                reason = f"it unpickles as {type(error).__qualname__}, not an exception"
            else:
                error.add_note(f"raised by loader worker {worker} on batch {batch} ({samples})")
                error.__cause__ = remote
                return error
    failure = LoaderWorkerError(f"{where} with {description}; not raised as itself: {reason}",
                                worker=worker, batch=batch)
    failure.__cause__ = remote
    return failure


def _describe(error: BaseException) -> str:
    """`module.Type: message` (a builtin's type without its module)."""
    kind = type(error)
    name = (kind.__qualname__ if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}")
    try:
        message = str(error)
    except Exception:
        message = "<str() failed>"
    return f"{name}: {message}" if message else name


def _bounded(text: str, max_bytes: int) -> bytes:
    """`text` in UTF-8, cut to `max_bytes` (ending in "...") where longer."""
    data = text.encode(errors="replace")
    return data if len(data) <= max_bytes else data[:max_bytes - 3] + b"..."


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def niceness_of_this_thread(increment: int) -> int:
    """This thread's nice level plus `increment`, clamped to the valid range."""
    return max(-20, min(19, os.getpriority(os.PRIO_PROCESS, 0) + increment))

