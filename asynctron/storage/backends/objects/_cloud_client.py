"""`CloudClient`: the set-up every cloud's `ObjectClient` (S3, Azure Blob, GCS) shares, so
that each keeps only what differs: its SDK's connections and what its answers mean.

A client holds its config and endpoint; `requests` (`StoreRequests`), which runs its requests
bounded by this process's share of the store's request budget and retries them inside the
deadline, reading failures through the cloud's `StoreErrors`; and its connections, one set
per event loop (the store I/O loop's; a forked child's loop gets its own), made on first use
by the cloud's `_connect` and closed on their loop by `aclose`, at exit, or once the client
is collected.
"""

from __future__ import annotations

import abc
import asyncio
import weakref
from typing import Generic, TypeVar

from asynctron.storage.backends.objects._client import PartLimits
from asynctron.storage.backends.objects._io_loop import (
    Closable,
    close_at_exit,
    close_when_collected,
)
from asynctron.storage.backends.objects._request_budget import world_size
from asynctron.storage.backends.objects._requests import StoreErrors, StoreRequests
from asynctron.storage.backends.objects._store_config import StoreConfig

L = TypeVar("L", bound=Closable)


class CloudClient(abc.ABC, Generic[L]):
    """A cloud's client, less its requests: `L` is one loop's connections. Subclasses set
    `schemes` and `limits` and make a loop's connections in `_connect`. Concurrency: any
    number of tasks on any loops (requests run on the store I/O loop)."""

    schemes: tuple[str, ...]
    limits: PartLimits

    def __init__(self, config: StoreConfig, endpoint: str, errors: StoreErrors) -> None:
        self.config = config
        self.endpoint = endpoint
        self.requests = StoreRequests(
            endpoint, errors, deadline_s=config.deadline_s,
            max_in_flight=lambda: config.process_requests(world_size()))
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, L] = (
            weakref.WeakKeyDictionary())
        self._opening: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary())
        close_at_exit(self)
        close_when_collected(self, self._clients)

    @property
    def most_in_flight(self) -> int:
        return self.requests.most_in_flight

    @abc.abstractmethod
    async def _connect(self) -> L:
        """The running loop's connections, made (once per loop)."""

    async def _loop_client(self) -> L:
        """The running loop's connections, made on first use (once, however many tasks ask
        at once)."""
        loop = asyncio.get_running_loop()
        found = self._clients.get(loop)
        if found is not None:
            return found
        async with self._opening.setdefault(loop, asyncio.Lock()):
            found = self._clients.get(loop)
            if found is None:
                found = self._clients[loop] = await self._connect()
        return found

    async def aclose(self) -> None:
        """On the I/O loop: close its connections there."""
        found = self._clients.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found.aclose()
