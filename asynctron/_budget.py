"""`ByteBudget`: a bound on bytes held at once (staging slabs, temporaries), as an object.

Modelled on trio's CapacityLimiter: waiters are served first come, first served; a request
larger than the whole budget is admitted alone (when nothing else is held), so it never waits
forever; the total is settable and validated; `statistics()` is a frozen record.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from asynctron.errors import WouldBlock


@dataclass(frozen=True, slots=True)
class BudgetStatistics:
    """A snapshot of a `ByteBudget`."""

    total_bytes: int
    borrowed_bytes: int
    peak_borrowed_bytes: int
    num_waiting: int


class ByteBudget:
    """At most `total_bytes` borrowed at once (one oversized request may borrow alone).

    Concurrency: any number of tasks on one event loop; not thread-safe.
    """

    def __init__(self, total_bytes: int) -> None:
        self._total = self._check_total(total_bytes)
        self._borrowed = 0
        self._peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @staticmethod
    def _check_total(total_bytes: int) -> int:
        if not isinstance(total_bytes, int) or isinstance(total_bytes, bool) or total_bytes < 1:
            raise ValueError(f"total_bytes: expected a positive int, found {total_bytes!r}")
        return total_bytes

    @property
    def total_bytes(self) -> int:
        return self._total

    @total_bytes.setter
    def total_bytes(self, value: int) -> None:
        self._total = self._check_total(value)
        self._wake()

    @property
    def borrowed_bytes(self) -> int:
        return self._borrowed

    def _fits(self, nbytes: int) -> bool:
        return self._borrowed + nbytes <= self._total or self._borrowed == 0

    def _take(self, nbytes: int) -> None:
        self._borrowed += nbytes
        self._peak = max(self._peak, self._borrowed)

    def acquire_nowait(self, nbytes: int) -> None:
        """Borrow `nbytes` now or raise `WouldBlock` (also when others are already waiting)."""
        if nbytes < 0:
            raise ValueError(f"nbytes: expected >= 0, found {nbytes!r}")
        if self._waiters or not self._fits(nbytes):
            raise WouldBlock(f"budget of {self._total} bytes: {self._borrowed} borrowed, "
                             f"{nbytes} more do not fit")
        self._take(nbytes)

    async def acquire(self, nbytes: int) -> None:
        """Borrow `nbytes`, waiting (in arrival order) until they fit.

        Cancellation: a cancelled waiter borrows nothing.
        """
        try:
            self.acquire_nowait(nbytes)
            return
        except WouldBlock:
            pass
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)  # granted just as we were cancelled: give it back
            else:
                if entry in self._waiters:  # `_wake` may have dropped it already (cancelled)
                    self._waiters.remove(entry)
                self._wake()
            raise

    def release(self, nbytes: int) -> None:
        """Return `nbytes` borrowed earlier.

        Raises:
            ValueError: `nbytes` is negative or more than is borrowed (nothing changes).
        """
        if not 0 <= nbytes <= self._borrowed:
            raise ValueError(f"budget: releasing {nbytes} bytes, but {self._borrowed} are "
                             "borrowed; release only what acquire() took")
        self._borrowed -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, waiter = self._waiters.popleft()
            if not waiter.done():
                self._take(nbytes)
                waiter.set_result(None)

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(self._total, self._borrowed, self._peak, len(self._waiters))

    def __repr__(self) -> str:
        return (f"<ByteBudget {self._borrowed}/{self._total} bytes borrowed, peak {self._peak}, "
                f"{len(self._waiters)} waiting>")
