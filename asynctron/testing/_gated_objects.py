"""`GatedObjectClient`: a real object-store client whose next call of a kind is held at its
start until the test releases it, so cancellation tests order events without sleeps.

    client = GatedObjectClient(S3Client(config))
    engine = Engine(backend=ObjectStoreBackend(client))
    gate = client.hold("upload_part")
    task = asyncio.create_task(engine.save(state, url))
    await gate.reached()                                   # a part is about to go up
    task.cancel()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

from asynctron.storage.backends.objects import ObjectClient, ObjectUrl
from asynctron.testing._gate import Gate

ObjectGatePoint = Literal["put", "upload_part", "complete_upload", "get_into", "list"]
"""The calls a `GatedObjectClient` can hold: a whole-object write (a claim, a manifest), a
part, an upload's completion, a ranged read, a listing."""


class GatedObjectClient:
    """`client`, with `hold` (every other attribute is the client's own)."""

    def __init__(self, client: ObjectClient) -> None:
        self.inner = client
        self._lock = threading.Lock()
        self._gates: list[tuple[ObjectGatePoint, Callable[[ObjectUrl], bool], Gate]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def hold(self, point: ObjectGatePoint, *,
             where: Callable[[ObjectUrl], bool] = lambda url: True) -> Gate:
        """Hold the next `point` call whose object `where` accepts, at its start (before any
        request), until `Gate.release`."""
        gate = Gate(point)
        with self._lock:
            self._gates.append((point, where, gate))
        return gate

    async def _pass(self, point: ObjectGatePoint, url: ObjectUrl) -> None:
        with self._lock:
            found = next((entry for entry in self._gates
                          if entry[0] == point and entry[1](url)), None)
            if found is not None:
                self._gates.remove(found)
        if found is not None:
            await found[2]._pass()

    async def put(self, url: ObjectUrl, body: bytes | memoryview, **options: Any) -> None:
        await self._pass("put", url)
        await self.inner.put(url, body, **options)

    async def upload_part(self, url: ObjectUrl, upload_id: str, number: int,
                          body: bytes | memoryview) -> str:
        await self._pass("upload_part", url)
        return await self.inner.upload_part(url, upload_id, number, body)

    async def complete_upload(self, url: ObjectUrl, upload_id: str,
                              tags: Sequence[str]) -> None:
        await self._pass("complete_upload", url)
        await self.inner.complete_upload(url, upload_id, tags)

    async def get_into(self, url: ObjectUrl, offset: int, buffers: Sequence[memoryview],
                       **options: Any) -> None:
        await self._pass("get_into", url)
        await self.inner.get_into(url, offset, buffers, **options)

    async def list(self, folder: ObjectUrl, *, recursive: bool = False) -> Any:
        await self._pass("list", folder)
        return await self.inner.list(folder, recursive=recursive)
