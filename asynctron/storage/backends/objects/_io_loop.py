"""The store I/O loop: one uvloop per process, on a thread of its own, where every request of
every object-store client runs.

Every byte a request sends or receives is handled there, so the caller's loop (a trainer's)
only awaits each request's outcome and its heartbeat never waits on a socket copy; a
cancelled caller waits until its request is cancelled there, so no buffer it lends is
touched after. A forked child starts a loop of its own. At exit the clients registered with
`close_at_exit` are closed on it (no connection left for the collector), then it stops.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from asynctron._concurrency import uncancellable
from asynctron._loop_thread import LoopThread
from asynctron.storage.backends._operation import store_operation

T = TypeVar("T")

_PAGE_BYTES = 4096


class Closable(Protocol):
    async def aclose(self) -> None: ...


_IO_LOCK = threading.Lock()
_IO: tuple[int, LoopThread] | None = None
"""The process's store I/O loop, and the pid that started it (a forked child starts its own)."""
_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def io_loop() -> LoopThread:
    """The process's store I/O loop, started on first use."""
    global _IO
    with _IO_LOCK:
        if _IO is None or _IO[0] != os.getpid():
            _IO = (os.getpid(), LoopThread("asynctron-store-io"))
        return _IO[1]


def close_at_exit(client: Closable) -> None:
    """Close `client` on the I/O loop when the process exits (if it is still alive then)."""
    _CLIENTS.add(client)


def close_when_collected(owner: object, clients: weakref.WeakKeyDictionary[
        asyncio.AbstractEventLoop, Closable]) -> None:
    """Once `owner` is collected, close its `clients` (one per loop) on their loops."""
    weakref.finalize(owner, _close_on_their_loops, clients)


def _close_on_their_loops(clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                                             Closable]) -> None:
    for loop, client in list(clients.items()):
        if not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)


async def on_io_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` on the I/O loop (directly, if already on it) and return its outcome.
    If the caller is cancelled, the coroutine is cancelled there and this waits until it has
    stopped, then raises CancelledError."""
    io = io_loop()
    caller = asyncio.get_running_loop()
    if caller is io.loop:
        return await coroutine
    outcome: asyncio.Future[T] = caller.create_future()
    started: concurrent.futures.Future[asyncio.Task[T]] = concurrent.futures.Future()

    def start() -> None:  # on the I/O loop
        task = io.loop.create_task(coroutine)
        task.add_done_callback(lambda done: caller.call_soon_threadsafe(_settle, outcome, done))
        started.set_result(task)

    io.loop.call_soon_threadsafe(start)
    try:
        return await asyncio.shield(outcome)
    except asyncio.CancelledError:
        if not outcome.done():
            io.loop.call_soon_threadsafe(started.result().cancel)
            await uncancellable(outcome)
        raise


def blocking(coroutine: Coroutine[Any, Any, T], what: str = "object store call") -> T:
    """Run `coroutine` on the I/O loop as one store operation (one clock for its requests),
    and wait for its outcome on this thread (a dataset worker's, a builder's)."""
    return io_loop().call(one_operation(coroutine), what)


async def one_operation(coroutine: Coroutine[Any, Any, T]) -> T:
    """`coroutine`'s requests as one store operation: a dataset call fails once the store
    has answered none of them for the deadline, however many ranges it reads."""
    with store_operation("read"):
        return await coroutine


def touch_pages(buffers: Sequence[memoryview]) -> None:
    """Blocks: write one byte per page of each buffer (whose bytes are about to be read into
    it), so the first touch of fresh pages (several times a warm write on a VM) happens here,
    on the executor, not in the loop's copies."""
    for buffer in buffers:
        if buffer.nbytes >= _PAGE_BYTES and not buffer.readonly:
            array = np.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer,
                                  dtype=np.uint8)
            array[::_PAGE_BYTES] = 0  # its bytes are about to be overwritten


def _settle(outcome: asyncio.Future[T], task: asyncio.Task[T]) -> None:
    """On the caller's loop: pass the I/O loop task's outcome on."""
    if outcome.done():
        return
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())  # type: ignore[arg-type]
    else:
        outcome.set_result(task.result())


@atexit.register
def _close_io_loop() -> None:
    """Close the clients on the I/O loop and stop it."""
    with _IO_LOCK:
        found = _IO
    if found is None or found[0] != os.getpid():
        return
    io = found[1]
    clients = list(_CLIENTS)

    async def close() -> None:
        for client in clients:
            await client.aclose()

    with contextlib.suppress(Exception):
        io.submit(close()).result(timeout=5)
    io.stop()
