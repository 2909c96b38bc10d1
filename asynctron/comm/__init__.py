"""Comm: gradient buckets whose all-reduces are asyncio awaitables, the Work → asyncio bridge,
and awaitable object collectives for coordination.

- `BucketManager` / `AsyncDataParallel`: a model's gradients in buckets, all-reduced while backward
  runs; `await synchronize()` before `optimizer.step()`.
- `wait_work` / `wait_future`: any torch.distributed `Work` or `torch.futures.Future`, awaited.
- `CollectiveGroup` / `new_gloo_group`: all-gather, gather, broadcast of objects and barriers
  on a dedicated gloo group, with a timeout that turns a dead peer into `PeerError`.
- `PeerChannel`: point-to-point messages (a header, then payload buffers sent from where they
  lie) between two ranks of such a group: checkpoint replicas.

Nothing here imports `asynctron.engine`; blocking waits go through a `RunBlocking` door the
caller passes in (`engine.run_blocking`).
"""

from asynctron.comm._bridge import wait_future, wait_work
from asynctron.comm._bucket import AllReduceTask, Bucket
from asynctron.comm._collectives import CollectiveGroup, new_gloo_group
from asynctron.comm._data_parallel import AsyncDataParallel
from asynctron.comm._manager import BucketConfig, BucketManager, StepTimings
from asynctron.comm._p2p import PeerChannel

__all__ = [
    "AllReduceTask",
    "AsyncDataParallel",
    "Bucket",
    "BucketConfig",
    "BucketManager",
    "CollectiveGroup",
    "PeerChannel",
    "StepTimings",
    "new_gloo_group",
    "wait_future",
    "wait_work",
]
