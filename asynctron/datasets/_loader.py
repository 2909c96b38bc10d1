"""`AsyncLoader`: `async for batch in loader`, with the pages of coming samples read ahead.

Pipeline (two tasks owned by the loader, joined by queues):

```
plan     for each coming batch of this rank: read its indices (their pages populated first, off
         the loop), find the .bin byte ranges of its samples, borrow their page-rounded size from
         the prefetch budget (waiting while it is spent), advise WILLNEED (the kernel starts the
         reads and returns) ──▶ planned queue
assemble take the next planned batch; populate its .bin pages (off the loop, waiting for the
         reads); cut the samples from the resident pages and collate them on the loop; give the
         bytes back to the budget ──▶ ready queue (num_ready_batches) ──▶ `async for`
```

Sample order is megatron's pretraining sampler: global batch `g` is samples
`[g * B, (g + 1) * B)` with `B = micro_batch_size * data_parallel_size`, and rank `r` takes the
`r`-th `micro_batch_size` of them. The position is `consumed_samples`, global, so a resume on a
different number of ranks with the same global batch continues with the same samples.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asynctron._budget import ByteBudget
from asynctron._concurrency import RunBlocking, first_error, uncancellable
from asynctron.datasets import _pages
from asynctron.datasets._blended import BlendedDataset
from asynctron.datasets._gpt import GPTDataset
from asynctron.datasets._indexed import IndexedDataset
from asynctron.errors import ClosedError, WouldBlock

STATE_VERSION = 1
#: samples whose index pages are read in one round of calls when planning
PLAN_WINDOW_SAMPLES = 256
#: most planned batches whose pages are populated in one call before assembly
ASSEMBLE_BATCHES = 8

Collate = Callable[[list[dict[str, Any]]], dict[str, Any]]


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


@dataclass(slots=True)
class _Plan:
    """One batch, its sample parts located and its .bin pages advised."""

    sample_ids: list[int]
    parts: list[tuple[Any, Any]]  # per sample: (GPTDataset, parts) or (dataset_id, ...)
    ranges: list[_pages.Range] = field(default_factory=list)
    nbytes: int = 0


class AsyncLoader:
    """Batches of `dataset` for one data-parallel rank, prefetched under a byte budget.

    Use as `async with AsyncLoader(...) as loader: async for batch in loader: ...`.

    Args:
        dataset: a `GPTDataset` or `BlendedDataset` (prefetched); any other map-style dataset
            is read as is, on the loop, without prefetch.
        micro_batch_size: samples per batch on this rank.
        run_blocking: the door for blocking calls, e.g. `engine.run_blocking`.
        prefetch_budget: bytes of advised-but-not-yet-assembled data pages, as an int (a new
            `ByteBudget`) or a `ByteBudget` to share.
        num_ready_batches: assembled batches kept ready ahead of the consumer.
        data_parallel_rank, data_parallel_size: this rank and the number of ranks.
        collate: turns a list of sample dicts into a batch (default: `collate`).

    Memory: the budget bounds the data pages asked for ahead; `num_ready_batches` assembled
    batches are held.
    Concurrency: one consumer; a second `async for` at the same time is not supported.
    """

    def __init__(self, dataset: Any, *, micro_batch_size: int, run_blocking: RunBlocking,
                 prefetch_budget: int | ByteBudget, num_ready_batches: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1,
                 collate: Collate = collate) -> None:
        for name, value, low in (("micro_batch_size", micro_batch_size, 1),
                                 ("num_ready_batches", num_ready_batches, 1),
                                 ("data_parallel_size", data_parallel_size, 1),
                                 ("data_parallel_rank", data_parallel_rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}: expected an int >= {low}, found {value!r}")
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(f"data_parallel_rank: expected < data_parallel_size "
                             f"({data_parallel_size}), found {data_parallel_rank}")
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
        self._producer: asyncio.Task[None] | None = None
        self._ready: asyncio.Queue[Any] | None = None
        self._entered = False
        self._closed = False

    # position ---------------------------------------------------------------------------------

    @property
    def samples_per_step(self) -> int:
        """Samples all ranks consume per batch (`micro_batch_size * data_parallel_size`)."""
        return self.micro_batch_size * self.data_parallel_size

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
        """
        if self._producer is not None:
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

    def _sample_ids(self, start: int) -> list[int]:
        first = start + self.data_parallel_rank * self.micro_batch_size
        return list(range(first, first + self.micro_batch_size))

    # lifetime ---------------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncLoader:
        if self._closed:
            raise ClosedError("loader: closed; create a new AsyncLoader")
        self._entered = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop prefetching and wait for the loader's tasks.

        Cancellation: the tasks are still awaited (their executor calls finish) before the
        cancellation propagates; the budget is returned either way.
        """
        self._closed = True
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()
            await uncancellable(self._producer)
        if self._producer is not None and not self._producer.cancelled():
            self._producer.exception()  # already handed to the consumer

    def __aiter__(self) -> AsyncLoader:
        return self

    async def __anext__(self) -> dict[str, Any]:
        """The next batch of this rank.

        Raises:
            StopAsyncIteration: the dataset has no further whole step.
        Cancellation: no batch is lost; the next call returns the batch this one would have.
        """
        if not self._entered:
            raise RuntimeError("loader: iterate inside `async with AsyncLoader(...) as loader`")
        if self._closed:
            raise ClosedError("loader: closed; create a new AsyncLoader")
        if self._producer is None:
            self._ready = asyncio.Queue(maxsize=self.num_ready_batches)
            self._producer = asyncio.get_running_loop().create_task(
                self._produce(self.consumed_samples, self._ready), name="asynctron-loader")
        assert self._ready is not None
        item = await self._ready.get()
        if isinstance(item, BaseException):
            self._ready.put_nowait(item)  # every later call raises it too
            raise item
        if item is None:
            self._ready.put_nowait(None)
            raise StopAsyncIteration
        self.consumed_samples += self.samples_per_step
        return item

    # producer ---------------------------------------------------------------------------------

    async def _produce(self, start: int, ready: asyncio.Queue[Any]) -> None:
        planned: asyncio.Queue[_Plan | None] = asyncio.Queue()
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._plan_all(start, planned))
                group.create_task(self._assemble_all(planned, ready))
        except BaseException as error:  # handed to the consumer, unless we are closing
            # (not `task.cancelling()`: on 3.11 a failed TaskGroup leaves it raised)
            if isinstance(error, asyncio.CancelledError) or self._closed:
                raise
            await ready.put(first_error(error))
        finally:  # batches planned but never assembled give their bytes back
            while not planned.empty():
                plan = planned.get_nowait()
                if plan is not None:
                    self.budget.release(plan.nbytes)

    async def _plan_all(self, start: int, planned: asyncio.Queue[_Plan | None]) -> None:
        """Plan windows of batches; queue each batch once its bytes are borrowed, and advise
        the queued batches' pages in one call (before waiting for more budget)."""
        step = self.samples_per_step
        starts = range(start, len(self.dataset) - step + 1, step)
        window = max(1, PLAN_WINDOW_SAMPLES // self.micro_batch_size)
        for w0 in range(0, len(starts), window):
            plans = await self._plan_window([self._sample_ids(s) for s in starts[w0:w0 + window]])
            unadvised: list[_pages.Range] = []
            for plan in plans:
                try:
                    self.budget.acquire_nowait(plan.nbytes)
                except WouldBlock:
                    await self._advise(unadvised)
                    unadvised = []
                    await self.budget.acquire(plan.nbytes)
                planned.put_nowait(plan)  # from here on, its bytes are released by whoever
                unadvised.extend(plan.ranges)  # takes it from the queue (or the drain)
            await self._advise(unadvised)
        planned.put_nowait(None)

    async def _advise(self, ranges: list[_pages.Range]) -> None:
        """Start reading the pages of `ranges` (off the loop; returns once the reads are
        queued)."""
        if ranges:
            await self._run_blocking(_pages.advise_willneed, ranges)

    async def _populate(self, ranges: list[_pages.Range]) -> None:
        """Make `ranges` resident and mapped, off the loop."""
        if ranges:
            await self._run_blocking(_pages.populate, ranges)

    async def _assemble_all(self, planned: asyncio.Queue[_Plan | None],
                            ready: asyncio.Queue[Any]) -> None:
        """Populate the pages of every batch already planned, in one call, then assemble them
        in order."""
        done = False
        while not done:
            taken = [await planned.get()]
            while not planned.empty() and len(taken) < ASSEMBLE_BATCHES:
                taken.append(planned.get_nowait())
            done = taken[-1] is None
            pending = collections.deque(plan for plan in taken if plan is not None)
            try:
                await self._populate([r for plan in pending for r in plan.ranges])
                while pending:
                    plan = pending[0]
                    batch = self._collate([self._sample(parts) for parts in plan.parts])
                    self.budget.release(pending.popleft().nbytes)
                    await ready.put(batch)
            finally:  # batches not handed on give their bytes back
                for plan in pending:
                    self.budget.release(plan.nbytes)
        await ready.put(None)

    # planning ---------------------------------------------------------------------------------

    async def _populated(self, *arrays_rows: tuple[np.ndarray, np.ndarray]) -> None:
        """Populate the pages of `array[rows]` for each pair, in one blocking call."""
        await self._populate([r for array, rows in arrays_rows
                              for r in _pages.array_ranges(array, rows)])

    async def _plan_window(self, batches: list[list[int]]) -> list[_Plan]:
        """Locate the parts of every sample of `batches` (populating the index pages they read,
        level by level, one call per level for the whole window) and their .bin pages."""
        sample_ids = [i for batch in batches for i in batch]
        ids = np.asarray(sample_ids, np.int64)
        dataset = self.dataset
        parts: list[tuple[Any, Any]]
        if isinstance(dataset, BlendedDataset):
            await self._populated((dataset.dataset_index, ids),
                                  (dataset.dataset_sample_index, ids))
            targets = [dataset.locate(i) for i in sample_ids]
            parts = [(None, None)] * len(sample_ids)
            for gpt in dataset.datasets:
                mine = [k for k, (owner, _) in enumerate(targets) if owner is gpt]
                if mine:
                    located = await self._gpt_parts(gpt, [targets[k][1] for k in mine])
                    for k, found in zip(mine, located, strict=True):
                        parts[k] = (dataset.dataset_index[sample_ids[k]], (gpt, found))
        elif isinstance(dataset, GPTDataset):
            located = await self._gpt_parts(dataset, sample_ids)
            parts = [(None, (dataset, found)) for found in located]
        else:
            parts = [(None, (dataset, i)) for i in sample_ids]
        plans = []
        offset = 0
        for batch in batches:
            mine = parts[offset:offset + len(batch)]
            offset += len(batch)
            ranges = _bin_ranges(mine)
            plans.append(_Plan(batch, mine, ranges, _pages.total_bytes(ranges)))
        return plans

    async def _gpt_parts(self, gpt: GPTDataset, ids: Sequence[int]) -> list[Any]:
        """`gpt.sample_parts(i)` for each id, after populating the index pages they read."""
        rows = np.asarray(ids, np.int64)
        await self._populated((gpt.shuffle_index, rows))
        shuffled = gpt.shuffle_index[rows].astype(np.int64)
        both = np.concatenate([shuffled, shuffled + 1])
        await self._populated((gpt.sample_index, both))
        bounds = gpt.sample_index[both, 0].astype(np.int64)
        positions = np.concatenate([np.arange(b, e + 1) for b, e in zip(
            bounds[:len(ids)].tolist(), bounds[len(ids):].tolist(), strict=True)])
        await self._populated((gpt.document_index, positions))
        documents = gpt.document_index[positions].astype(np.int64)
        indexed = gpt.dataset
        await self._populated((indexed.sequence_pointers, documents),
                              (indexed.sequence_lengths, documents))
        return [gpt.sample_parts(i) for i in ids]

    def _sample(self, planned: tuple[Any, Any]) -> dict[str, Any]:
        dataset_id, (owner, found) = planned
        if not isinstance(owner, GPTDataset):
            return owner[found]
        sample = owner.sample_from_parts(found)
        if dataset_id is not None:
            return {"dataset_id": dataset_id, **sample}
        return sample

    def __repr__(self) -> str:
        return (f"<AsyncLoader rank {self.data_parallel_rank}/{self.data_parallel_size}, "
                f"{self.consumed_samples} samples consumed, {self.budget!r}>")


def _bin_ranges(parts: list[tuple[Any, Any]]) -> list[_pages.Range]:
    """Page ranges in the `.bin` maps of every located part."""
    starts: list[int] = []
    sizes: list[int] = []
    for _, (gpt, found) in parts:
        if not isinstance(gpt, GPTDataset):
            continue
        indexed: IndexedDataset = gpt.dataset
        base = indexed.tokens.ctypes.data
        for document, offset, count in found:
            start, nbytes = indexed.byte_range(document, offset, count)
            starts.append(base + start)
            sizes.append(nbytes)
    return _pages.page_ranges_of(np.array(starts, np.int64), np.array(sizes, np.int64))
