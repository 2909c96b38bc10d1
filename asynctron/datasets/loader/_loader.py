"""`AsyncLoader`: `async for batch in loader`, batches assembled ahead by worker processes.

For a `GPTDataset` or `BlendedDataset`, `num_workers` long-lived processes read the mapped
samples, cut and collate them into batch slabs in shared memory, and advise the kernel to read
the pages of coming batches (as far ahead as the prefetch budget lends bytes). The loop's part
of a batch is O(1) and never releases the GIL: a trainer thread busy in Python keeps it. A
batch's tensors are views of its slab, reused only once nothing refers to them or their
memory; they come round again with their slab, so dropping a batch frees no tensor (freeing
one gives up the GIL). While another thread holds the GIL (the loop's wake-ups come a switch
interval late), a consumer waiting for a batch wakes once every two switch intervals, for
every batch ready by then: each wake-up makes that thread switch (`_wake_pacing`).

Any other map-style dataset (or `num_workers=0`) is read in this process, `collate` of its
samples, one batch per call on the engine's executor.

Sample order is megatron's pretraining sampler: global batch `g` is samples
`[g * B, (g + 1) * B)` with `B = micro_batch_size * data_parallel_size`, and rank `r` takes the
`r`-th `micro_batch_size` of them. The position is `consumed_samples`, global, so a resume on a
different number of ranks with the same global batch continues with the same samples.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Callable, Collection
from typing import Any, Literal

import numpy as np
import torch

from asynctron._budget import ByteBudget
from asynctron._concurrency import RunBlocking, uncancellable
from asynctron.datasets.formats._blended import BlendedDataset
from asynctron.datasets.loader import _pages
from asynctron.datasets.loader._batches import BatchLayout
from asynctron.datasets.loader._shared_slabs import SharedSlabs
from asynctron.datasets.loader._workers import BatchWorkers, niceness_of_this_thread
from asynctron.errors import ClosedError

STATE_VERSION = 1

Collate = Callable[[list[dict[str, Any]]], dict[str, Any]]
Batch = dict[str, Any]


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack each key of the sample dicts along a new first dimension. A tensor that every
    sample shares (the cached causal mask) is expanded, not copied: the result is a read-only
    view of shape `(batch, *shape)`."""
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [sample[key] for sample in samples]
        first = values[0]
        if isinstance(first, torch.Tensor):
            if all(v is first for v in values):
                out[key] = first.unsqueeze(0).expand(len(values), *first.shape)
            else:
                out[key] = torch.stack(values)
        else:
            out[key] = torch.as_tensor(np.asarray(values))
    return out


class AsyncLoader:
    """Batches of `dataset` for one data-parallel rank, assembled ahead of the consumer.

    Use as `async with AsyncLoader(...) as loader: async for batch in loader: ...`.

    Args:
        dataset: a `GPTDataset` or `BlendedDataset` (assembled by worker processes, pages
            prefetched); any other map-style dataset is read in this process.
        micro_batch_size: samples per batch on this rank.
        run_blocking: the door for blocking calls, e.g. `engine.run_blocking`.
        prefetch_budget: bytes of data pages advised ahead and not yet assembled, as an int
            (a new `ByteBudget`) or a `ByteBudget` to share.
        num_ready_batches: batches asked for ahead of the consumer (being assembled or ready).
        data_parallel_rank, data_parallel_size: this rank and the number of ranks.
        collate: turns a list of sample dicts into a batch, where batches are read in this
            process (default: `collate`).
        num_workers: worker processes (0: read in this process, one batch per executor call,
            without prefetch).
        start_method: how workers start (`multiprocessing`): "fork" (default: milliseconds,
            as torch's DataLoader on Linux), "forkserver" or "spawn" (the dataset is pickled
            and reopens its files).
        worker_nice_increment: workers run at this thread's nice level plus this, so a
            trainer keeps its cores.
        worker_cpus: the CPUs the workers may run on: "away" (default): this process's CPUs
            but those where its busy threads run (more than half a core, looked at four times
            a second), followed as they move, so a worker the loop wakes does not land on the
            core a trainer thread is waiting to get back (`docs/datasets.md`); a collection of
            CPUs: those, fixed (e.g. the cores a node's binding leaves to the loader); None:
            wherever the scheduler puts them.
        pin_memory: page-lock batch memory for CUDA (where CUDA is available), so
            `batch[k].to("cuda", non_blocking=True)` is asynchronous.

    Memory: the budget bounds the data pages asked for ahead; the loader holds at most
    `num_ready_batches` batches; batches the consumer keeps are its own (a slab is reused only
    once nothing refers to its batch's tensors or their memory: views, numpy arrays, autograd).
    Concurrency: one consumer; a second `async for` at the same time is not supported.
    """

    def __init__(self, dataset: Any, *, micro_batch_size: int, run_blocking: RunBlocking,
                 prefetch_budget: int | ByteBudget, num_ready_batches: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1,
                 collate: Collate = collate, num_workers: int = 2,
                 start_method: str = "fork", worker_nice_increment: int = 10,
                 worker_cpus: Collection[int] | Literal["away"] | None = "away",
                 pin_memory: bool = False) -> None:
        for name, value, low in (("micro_batch_size", micro_batch_size, 1),
                                 ("num_ready_batches", num_ready_batches, 1),
                                 ("data_parallel_size", data_parallel_size, 1),
                                 ("data_parallel_rank", data_parallel_rank, 0),
                                 ("num_workers", num_workers, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, found {value!r}")
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(f"data_parallel_rank: expected < data_parallel_size "
                             f"({data_parallel_size}), found {data_parallel_rank}")
        if start_method not in ("fork", "forkserver", "spawn"):
            raise ValueError(f"start_method: expected 'fork', 'forkserver' or 'spawn', found "
                             f"{start_method!r}")
        cpus: frozenset[int] | Literal["away"] | None
        if worker_cpus is None or worker_cpus == "away":
            cpus = worker_cpus
        elif isinstance(worker_cpus, str):
            raise ValueError(f"worker_cpus: expected 'away', None or a set of CPUs, found "
                             f"{worker_cpus!r}")
        else:
            cpus = frozenset(worker_cpus)
            if not (cpus and cpus <= os.sched_getaffinity(0)):
                raise ValueError(f"worker_cpus: expected a non-empty subset of this process's "
                                 f"CPUs {sorted(os.sched_getaffinity(0))}, found {sorted(cpus)}")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.num_ready_batches = num_ready_batches
        self.budget = (prefetch_budget if isinstance(prefetch_budget, ByteBudget)
                       else ByteBudget(prefetch_budget))
        self._run_blocking = run_blocking
        self._collate = collate
        self.consumed_samples = 0
        self._workers: BatchWorkers | None = None  # made and started by `async with`
        self._worker_options: dict[str, Any] | None = None
        if num_workers and BatchLayout.supports(dataset):
            self._worker_options = {
                "num_workers": num_workers, "start_method": start_method,
                "pin_memory": pin_memory,
                "niceness": niceness_of_this_thread(worker_nice_increment), "cpus": cpus}
        self._pending: collections.deque[asyncio.Future[Batch]] = collections.deque()
        self._next_batch = 0
        self._num_batches: int | None = None  # set when iteration begins
        self._first_sample = 0
        self._waiter: asyncio.Future[None] | None = None
        self._entered = False
        self._closed = False

    # position ---------------------------------------------------------------------------------

    @property
    def samples_per_step(self) -> int:
        """Samples all ranks consume per batch (`micro_batch_size * data_parallel_size`)."""
        return self.micro_batch_size * self.data_parallel_size

    @property
    def worker_pids(self) -> list[int | None]:
        """The worker processes' ids (None before they start; empty without workers)."""
        return self._workers.pids if self._workers is not None else []

    def state_dict(self) -> dict[str, int]:
        """The position, JSON-able, to save in a checkpoint: samples consumed by all ranks."""
        return {"version": STATE_VERSION, "consumed_samples": self.consumed_samples,
                "dataset_length": len(self.dataset),
                "micro_batch_size": self.micro_batch_size,
                "data_parallel_size": self.data_parallel_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position (before iterating). The number of ranks and the micro
        batch may differ from the saved run's, as long as the position falls on a step.

        Raises:
            ValueError: another version or dataset, or a position that is not a whole step
                of this loader.
            RuntimeError: the loader is already iterating.
        """
        if self._num_batches is not None:
            raise RuntimeError("load_state_dict: expected a loader not yet iterating, found one "
                               "running; load the state before `async for`")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version: expected {STATE_VERSION}, found "
                             f"{state.get('version')!r}; it was saved by another asynctron")
        if state.get("dataset_length") != len(self.dataset):
            raise ValueError(f"loader state dataset_length: expected {len(self.dataset)}, found "
                             f"{state.get('dataset_length')!r}; the state belongs to another "
                             "dataset")
        consumed = state["consumed_samples"]
        if not isinstance(consumed, int) or consumed < 0 or consumed % self.samples_per_step:
            raise ValueError(f"loader state consumed_samples: expected a multiple of "
                             f"micro_batch_size * data_parallel_size ({self.samples_per_step}), "
                             f"found {consumed!r}; resume at a global-batch boundary")
        self.consumed_samples = consumed

    # lifetime ---------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncLoader:
        """Start the workers (so they are up by the first batch)."""
        if self._closed:
            raise ClosedError("loader: closed; create a new AsyncLoader")
        if not self._entered and self._worker_options is not None:
            options = self._worker_options
            layout = BatchLayout(self.dataset, self.micro_batch_size)
            self._workers = BatchWorkers(
                self.dataset, layout,
                SharedSlabs(layout.slab_bytes, layout.field_tensors,
                            pin_memory=options["pin_memory"]),
                num_workers=options["num_workers"], ring_size=self.num_ready_batches + 1,
                micro_batch_size=self.micro_batch_size, samples_per_step=self.samples_per_step,
                budget=self.budget,
                read_bytes_per_batch=self.micro_batch_size * _read_bytes(self.dataset),
                start_method=options["start_method"], niceness=options["niceness"],
                cpus=options["cpus"],
                on_progress=self._wake)
            try:
                await self._workers.start(self._run_blocking)
            except BaseException:
                await self.aclose()
                raise
        self._entered = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the workers and wait for batches being read in this process; batches already
        handed out stay valid. The budget is returned.

        Cancellation: the workers are still stopped and the reads awaited before the
        cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        work = asyncio.ensure_future(self._shut_down())
        await uncancellable(work)
        work.result()

    async def _shut_down(self) -> None:
        if self._workers is not None:
            await self._workers.aclose()
        reads = [future for future in self._pending if not future.done()]
        if reads:
            await asyncio.wait(reads)
        for future in self._pending:
            if not future.cancelled():
                future.exception()  # handed to the consumer, or never asked for
        self._pending.clear()

    def __aiter__(self) -> AsyncLoader:
        return self

    async def __anext__(self) -> Batch:
        """The next batch of this rank.

        Raises:
            StopAsyncIteration: the dataset has no further whole step.
            Exception: the error the dataset raised on this batch, as itself (its type,
                message and attributes: a `CorruptDatasetError` keeps its path), whether read
                in this process or by a worker; from a worker, `__cause__` holds the worker's
                traceback text and a note names the worker and the batch. Later calls raise it
                too.
            LoaderWorkerError: a worker died; or its error could not be raised as itself (it
                does not pickle, its pickle is too large for a worker's report, it does not
                unpickle here, or it is a StopIteration), and then names its type, message and
                why, with the traceback in `__cause__`. Later calls raise it too.
            RuntimeError: called outside `async with` (the loader is not started).
            ClosedError: the loader is closed.
        Cancellation: no batch is lost; the next call returns the batch this one would have.
        Every call gives the loop at least one turn, even when its batch is ready.
        """
        if not self._entered:
            raise RuntimeError("loader: iterate inside `async with AsyncLoader(...) as loader`")
        if self._closed:
            raise ClosedError("loader: closed; create a new AsyncLoader")
        if self._num_batches is None:
            self._begin()
        if not self._pending:
            raise StopAsyncIteration
        future = self._pending[0]
        if self._workers is not None and not future.done():
            self._workers.poll()
        if future.done():
            # A checkpoint (as every trio await is): a trainer whose batches are always ready
            # still gives the loop one turn a step, so saves and collectives in flight go on
            # (without it, steps ran back to back and the loop stalled for several of them).
            await asyncio.sleep(0)
        while not future.done():  # a cancelled wait leaves the batch coming
            if self._workers is None:
                await asyncio.wait((future,))
                continue
            pacing = self._workers.pacing
            if pacing.contended:
                # another thread holds the GIL, and each wake-up makes it switch: wake once
                # every two switch intervals, for every batch ready by then (`_wake_pacing`)
                await pacing.sleep()
                if self._closed:
                    raise ClosedError("loader: closed while waiting for a batch")
                self._workers.poll()
                continue
            # woken straight from the workers' records: one loop turn, not a future's two
            self._workers.watch()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch = future.result()  # a failure stays first in line: later calls raise it too
        self._pending.popleft()
        self.consumed_samples += self.samples_per_step
        self._ask_ahead()
        return batch

    # batches ----------------------------------------------------------------------------------

    def _begin(self) -> None:
        step = self.samples_per_step
        self._num_batches = max(0, (len(self.dataset) - self.consumed_samples) // step)
        self._first_sample = self.consumed_samples + self.data_parallel_rank * self.micro_batch_size
        if self._workers is not None:
            self._workers.begin(self._first_sample, self._num_batches)
        self._ask_ahead()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _ask_ahead(self) -> None:
        """Ask for batches until `num_ready_batches` are on their way or ready."""
        assert self._num_batches is not None
        while len(self._pending) < self.num_ready_batches and (
                self._next_batch < self._num_batches):
            batch = self._next_batch
            self._next_batch += 1
            if self._workers is not None:
                self._pending.append(self._workers.submit(batch))
            else:
                first = self._first_sample + batch * self.samples_per_step
                self._pending.append(asyncio.ensure_future(self._run_blocking(
                    self._read, range(first, first + self.micro_batch_size))))

    def _read(self, ids: range) -> Batch:
        """A batch read in this process (on an executor thread)."""
        return self._collate([self.dataset[i] for i in ids])

    def __repr__(self) -> str:
        how = (f"{self._worker_options['num_workers']} workers"
               if self._worker_options is not None else "in process")
        return (f"<AsyncLoader rank {self.data_parallel_rank}/{self.data_parallel_size}, "
                f"{self.consumed_samples} samples consumed, {how}, {self.budget!r}>")


def _read_bytes(dataset: Any) -> int:
    """Bytes of data pages one sample of `dataset` reads, at most (for the budget)."""
    parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    return max((part.config.sequence_length + 1) * part.dataset.dtype.itemsize
               + 2 * _pages.PAGE_BYTES for part in parts)
